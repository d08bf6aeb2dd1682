"""The operator controls' statements answer alike on the in-memory twin and on
PostgreSQL: pause, resume and its catch-up, trigger, rerun, the audit and ``why``."""

from __future__ import annotations

import pytest

from celery_pglock import _controls as controls
from celery_pglock._controls import Target
from tests.contract.conftest import Store

NS = "contract"
LOCK = f"{NS}:tasks.bill"
SLOT = "2026-12-04T10:00:00Z"


def target(store: Store, actor: str = "ann@host") -> Target:
    return Target(store.statements.tables, NS, actor)


def test_a_second_pause_keeps_the_first_and_is_audited_once(store: Store) -> None:
    first = controls.pause(store.statements, target(store), "bill", "disk full")
    again = controls.pause(store.statements, target(store, "bob@host"), "bill", "other")

    assert (first["new"], first["paused_by"], first["reason"]) == (True, "ann@host", "disk full")
    assert (again["new"], again["paused_by"], again["reason"]) == (False, "ann@host", "disk full")
    trail = controls.why(store.statements, target(store), lock_name=LOCK, slot=SLOT, entry="bill")
    assert [(row["action"], row["actor"]) for row in trail["audit"]] == [("pause", "ann@host")]


def test_pauses_count_the_slots_held_back_since_the_pause(store: Store) -> None:
    controls.pause(store.statements, target(store), "bill", None)
    for slot in ("s1", "s2"):
        store.seed.send(NS, "bill", slot, lock_name=LOCK, paused=True)
    store.seed.send(NS, "bill", "s3", lock_name=LOCK)  # sent: not held back

    [paused] = controls.pauses(store.statements, target(store))

    assert (paused["entry"], paused["slots_held_back"]) == ("bill", 2)


def test_resume_of_an_entry_not_paused_changes_nothing(store: Store) -> None:
    assert controls.resume(store.statements, target(store), "bill", catch_up=3) is None


def test_resume_sends_the_newest_held_back_slots_oldest_first(store: Store) -> None:
    controls.pause(store.statements, target(store), "bill", None)
    for slot in ("s1", "s2", "s3"):
        store.seed.send(NS, "bill", slot, lock_name=LOCK, paused=True)
        store.seed.run(LOCK, slot, "paused", reason="paused")

    done = controls.resume(store.statements, target(store, "bob@host"), "bill", catch_up=2)

    assert done is not None
    assert done["caught_up"] == ["s2", "s3"]
    rows = controls.slot_rows(store.statements, LOCK, ["s1", "s2", "s3"])
    assert {slot: row["state"] for slot, row in rows.items()} == {
        "s1": "paused",
        "s2": "scheduled",
        "s3": "scheduled",
    }
    assert controls.pauses(store.statements, target(store)) == []
    [sent] = controls.why(store.statements, target(store), lock_name=LOCK, slot="s3", entry=None)[
        "sends"
    ]
    assert (sent["paused"], sent["sent_by"], sent["sends"]) == (False, "bob@host", 2)


def test_a_trigger_writes_its_slot_once_and_never_resends_a_success(store: Store) -> None:
    args = {"entry": "bill", "task": "tasks.bill", "lock_name": LOCK}
    first = controls.record_trigger(store.statements, target(store), **args, slot="m1")
    again = controls.record_trigger(store.statements, target(store), **args, slot="m1")
    store.seed.run(LOCK, "m2", "succeeded", token=7)
    done = controls.record_trigger(store.statements, target(store), **args, slot="m2")

    assert (first["inserted"], first["state"], first["send"]) == (1, None, True)
    assert (again["inserted"], again["state"], again["send"]) == (0, "scheduled", True)
    assert (done["inserted"], done["state"], done["token"], done["send"]) == (
        0,
        "succeeded",
        7,
        False,
    )
    row = controls.run_row(store.statements, LOCK, "m1")
    assert row is not None
    assert (row["state"], row["sent_by"], row["task_name"]) == (
        "scheduled",
        "ann@host",
        "tasks.bill",
    )


def test_reopen_fails_a_succeeded_slot_on_purpose_and_keeps_what_it_had(store: Store) -> None:
    store.seed.run(LOCK, SLOT, "succeeded", token=41, task_id="t-41")
    store.seed.run(LOCK, "other", "failed", token=3)

    before = controls.reopen(
        store.statements, target(store), lock_name=LOCK, slot=SLOT, reason="bad data"
    )
    not_done = controls.reopen(
        store.statements, target(store), lock_name=LOCK, slot="other", reason="x"
    )

    assert before is not None
    assert (before["state"], before["token"], before["task_id"]) == ("succeeded", 41, "t-41")
    assert not_done is None
    row = controls.run_row(store.statements, LOCK, SLOT)
    assert row is not None
    assert (row["state"], row["reason"]) == ("failed", "rerun by ann@host: bad data")
    [audited] = controls.why(
        store.statements, target(store), lock_name=LOCK, slot=SLOT, entry=None
    )["audit"]
    assert audited["action"] == "rerun"
    assert audited["detail"]["previous"]["token"] == 41


def test_why_gathers_the_slot_s_run_sends_skips_and_the_entry_s_trail(store: Store) -> None:
    controls.pause(store.statements, target(store), "bill", "maintenance")
    store.seed.run(LOCK, SLOT, "running", token=5)
    store.seed.send(NS, "bill", SLOT, lock_name=LOCK)
    store.seed.send(NS, "bill", "another-slot", lock_name=LOCK)
    store.seed.skip(LOCK, SLOT, "already running")
    store.seed.skip(LOCK, "another-slot", "already succeeded")
    controls.audit(
        store.statements, target(store), "backfill", lock_name=LOCK, slot=SLOT, sent=[SLOT]
    )

    found = controls.why(store.statements, target(store), lock_name=LOCK, slot=SLOT, entry="bill")

    assert found["run"]["token"] == 5
    assert [send["slot"] for send in found["sends"]] == [SLOT]
    assert [skip["reason"] for skip in found["skips"]] == ["already running"]
    assert [row["action"] for row in found["audit"]] == ["pause", "backfill"]
    assert found["audit"][1]["detail"] == {"sent": [SLOT]}
    assert found["holder"] is None


def test_a_lock_is_known_by_a_run_or_a_skip(store: Store) -> None:
    assert not controls.lock_has_rows(store.statements, LOCK)
    store.seed.skip(LOCK, None, "already running")
    assert controls.lock_has_rows(store.statements, LOCK)


def test_slot_rows_name_only_the_slots_that_have_one(store: Store) -> None:
    store.seed.run(LOCK, "a", "succeeded", token=1)
    store.seed.run(LOCK, "b", "failed", token=2, reason="boom")

    rows = controls.slot_rows(store.statements, LOCK, ["a", "b", "c"])

    assert {slot: (row["state"], row["reason"]) for slot, row in rows.items()} == {
        "a": ("succeeded", None),
        "b": ("failed", "boom"),
    }


def test_a_transaction_that_fails_leaves_nothing(store: Store) -> None:
    def pause_then_fail() -> None:
        with store.statements.transaction():
            controls.pause(store.statements, target(store), "bill", None)
            raise RuntimeError("stop")

    with pytest.raises(RuntimeError):
        pause_then_fail()

    assert controls.pauses(store.statements, target(store)) == []
