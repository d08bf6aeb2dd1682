"""Every operator action through its one home (``steering.actions``), as the CLI and the
dashboard call it, on the in-memory twin and on PostgreSQL alike: what it checks, what
it writes and audits, and what it hands to the face's ``Send`` (a recorder here)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery

from celery_pglock import _controls as controls
from celery_pglock.errors import ConfigurationError, UnknownEntry
from celery_pglock.steering import _replay as replay
from celery_pglock.steering import actions
from celery_pglock.steering._operator import Operator
from celery_pglock.steering.actions import NothingToDo
from celery_pglock.store.statements import Statements
from tests.contract.conftest import Store

NS = "contract"
ENTRY = "bill"
LOCK = f"{NS}:tasks.bill"
START = datetime(2026, 12, 4, 10, 0, tzinfo=timezone.utc)
END = datetime(2026, 12, 4, 10, 2, tzinfo=timezone.utc)


class Recorder:
    """A ``Send`` that writes down what it was given and the audit trail it found."""

    def __init__(self, outcome: str | None = None) -> None:
        self.sent: list[tuple[str, str, list[str]]] = []
        self.audited_before: list[list[str]] = []
        self.outcome = outcome

    def __call__(self, op: Operator, entry: Any, lock: str, plan: list[dict[str, Any]]) -> None:
        slots = [item["slot"] for item in plan if item["action"] == "send"]
        self.sent.append((entry.name, lock, slots))
        with op.connection() as statements:
            found = controls.why(
                statements, op.target, lock_name=lock, slot=slots[0], entry=entry.name
            )
        self.audited_before.append([row["action"] for row in found["audit"]])
        for item in plan:
            if self.outcome is not None and item["action"] == "send":
                item["outcome"] = self.outcome


@pytest.fixture
def app() -> Celery:
    app = Celery("contract", set_as_current=False)
    app.conf.update(
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
        pglock_dsn="postgresql://nobody@127.0.0.1:9/unused",  # never opened: op has an opener
        pglock_namespace=NS,
        beat_schedule={ENTRY: {"task": "tasks.bill", "schedule": 60.0}},
    )
    return app


@pytest.fixture
def op(app: Celery, store: Store) -> Operator:
    @contextmanager
    def opener() -> Iterator[Statements]:
        yield store.statements

    return Operator(app, "ann@host", "contract", opener=opener)


def trail(op: Operator, store: Store, slot: str | None = None) -> list[tuple[str, str]]:
    found = controls.why(store.statements, op.target, lock_name=LOCK, slot=slot or "-", entry=ENTRY)
    return [(row["action"], row["actor"]) for row in found["audit"]]


def test_pause_of_an_unknown_entry_is_refused_and_stores_nothing(
    op: Operator, store: Store
) -> None:
    with pytest.raises(UnknownEntry, match="did you mean bill"):
        actions.pause(op, "bil", "typo")
    assert controls.pauses(store.statements, op.target) == []


def test_pause_and_resume_are_audited_as_who_asked(op: Operator, store: Store) -> None:
    send = Recorder()
    actions.pause(op, ENTRY, "disk full")
    store.seed.send(NS, ENTRY, "s1", lock_name=LOCK, paused=True)

    done = actions.resume(op, ENTRY, catch_up=False, send=send)

    assert (done["caught_up"], done["outcomes"], send.sent) == ([], {}, [])
    assert trail(op, store) == [("pause", "ann@host"), ("resume", "ann@host")]


def test_resume_with_catch_up_sends_what_the_pause_held_back(op: Operator, store: Store) -> None:
    send = Recorder(outcome="succeeded")
    actions.pause(op, ENTRY, None)
    for slot in ("s1", "s2"):
        store.seed.send(NS, ENTRY, slot, lock_name=LOCK, paused=True)

    done = actions.resume(op, ENTRY, catch_up=True, send=send)

    assert send.sent == [(ENTRY, LOCK, ["s1", "s2"])]
    assert done["outcomes"] == {"s1": "succeeded", "s2": "succeeded"}


def test_resume_of_an_entry_not_paused_is_nothing_to_do(op: Operator) -> None:
    with pytest.raises(NothingToDo, match="not paused"):
        actions.resume(op, ENTRY, catch_up=True, send=Recorder())


def test_trigger_sends_a_manual_slot_once_audited(op: Operator, store: Store) -> None:
    send = Recorder()
    done = actions.trigger(op, ENTRY, slot=None, send=send)

    assert done["slot"].startswith(controls.MANUAL_PREFIX)
    assert send.sent == [(ENTRY, LOCK, [done["slot"]])]
    assert send.audited_before == [["trigger"]]


def test_trigger_of_a_succeeded_slot_sends_nothing(op: Operator, store: Store) -> None:
    store.seed.run(LOCK, "s1", "succeeded", token=9)
    send = Recorder()

    done = actions.trigger(op, ENTRY, slot="s1", send=send)

    assert (done["send"], done["token"], send.sent) == (False, 9, [])


def test_rerun_needs_a_reason_and_a_succeeded_slot(op: Operator, store: Store) -> None:
    store.seed.run(LOCK, "s1", "failed", token=2)
    with pytest.raises(ConfigurationError, match="reason is required"):
        actions.rerun(op, ENTRY, "s1", " ", send=Recorder())
    with pytest.raises(NothingToDo, match="has not succeeded"):
        actions.rerun(op, ENTRY, "s1", "bad data", send=Recorder())


def test_rerun_opens_the_slot_audits_what_it_had_and_sends_it(op: Operator, store: Store) -> None:
    store.seed.run(LOCK, "s1", "succeeded", token=4)
    send = Recorder(outcome="succeeded")

    done = actions.rerun(op, LOCK, "s1", "bad data", send=send)

    assert (done["previous"]["token"], done["outcome"], done["token"]) == (4, "succeeded", 4)
    assert send.sent == [(ENTRY, LOCK, ["s1"])]
    assert send.audited_before == [["rerun"]]


def test_backfill_is_audited_before_it_sends_what_never_succeeded(
    op: Operator, store: Store
) -> None:
    wanted = replay.slots_between(op.app, actions.Schedule(op.app).entry(ENTRY), START, END, 10)
    store.seed.run(LOCK, wanted[0], "succeeded", token=1)
    send = Recorder()

    found = actions.backfill(op, ENTRY, START, END, send=send)

    assert found.as_json()["sending"] == wanted[1:]
    assert send.sent == [(ENTRY, LOCK, wanted[1:])]
    assert send.audited_before == [["backfill"]]


def test_a_backfill_backwards_or_without_a_slot_is_refused(op: Operator) -> None:
    with pytest.raises(ConfigurationError, match="before from"):
        actions.backfill_plan(op, ENTRY, END, START)
    with pytest.raises(NothingToDo, match="no slot"):
        actions.backfill_plan(op, ENTRY, START.replace(second=1), START.replace(second=59))


def test_a_time_without_its_offset_is_refused() -> None:
    assert actions.moment("2026-12-04T10:00:00+02:00") == START.replace(hour=8)
    with pytest.raises(ConfigurationError, match="no UTC offset"):
        actions.moment("2026-12-04T10:00:00")


def test_a_release_outside_the_namespace_is_refused(op: Operator) -> None:
    with pytest.raises(ConfigurationError, match="--any-namespace"):
        actions.lock_to_release(op, "other:lock")
