"""Beat's claims (``beat.claims.BeatClaims``) answer alike on the in-memory twin and on
PostgreSQL: each due slot is claimed by one replica, a paused entry's slot is recorded and
not sent, a confirmation moves the entry's state forward only, and a claim never confirmed
is taken over."""

from __future__ import annotations

import dataclasses

from celery import Celery

from celery_pglock import _controls as controls
from celery_pglock.beat._claims import BeatClaims
from celery_pglock.beat._planner import Due
from celery_pglock.beat._settings import BeatSettings
from tests.contract.conftest import Store

NS = "contract"
BILL = f"{NS}:tasks.bill"
MAIL = f"{NS}:tasks.mail"
SLOTS = ["2026-12-04T10:00:00Z", "2026-12-04T10:01:00Z"]


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str
    task: str
    stored: bool = False  # an entry stored in PostgreSQL (beat's StoredEntry), not the code's


def replica(store: Store, name: str) -> BeatClaims:
    app = Celery("contract", set_as_current=False)
    app.conf.update(pglock_dsn="postgresql://nobody@127.0.0.1:9/unused", pglock_namespace=NS)
    settings = dataclasses.replace(BeatSettings.from_app(app), replica=name)
    return BeatClaims(settings, store.statements.rows)


def due(entry: str, lock: str, *slots: str) -> list[Due]:
    return [Due(Entry(entry, lock.removeprefix(f"{NS}:")), slot, lock) for slot in slots]


def test_each_due_slot_is_claimed_by_one_replica_and_recorded_scheduled(store: Store) -> None:
    wanted = due("bill", BILL, *SLOTS) + due("mail", MAIL, SLOTS[0])

    first = replica(store, "a:1").claim(wanted)
    second = replica(store, "b:2").claim(wanted + due("mail", MAIL, SLOTS[1]))

    assert first.send == {("bill", SLOTS[0]), ("bill", SLOTS[1]), ("mail", SLOTS[0])}
    assert (second.send, first.paused, second.paused) == ({("mail", SLOTS[1])}, set(), set())
    row = controls.run_row(store.statements, BILL, SLOTS[0])
    assert row is not None
    assert (row["state"], row["sent_by"], row["task_name"]) == ("scheduled", "a:1", "tasks.bill")


def test_a_slot_named_twice_in_one_tick_is_claimed_once(store: Store) -> None:
    found = replica(store, "a:1").claim(due("bill", BILL, SLOTS[0], SLOTS[0]))

    assert found.send == {("bill", SLOTS[0])}


def test_a_paused_entry_s_slot_is_recorded_paused_with_who_and_why(store: Store) -> None:
    target = controls.Target(store.statements.tables, NS, "ann@host")
    controls.pause(store.statements, target, "bill", "disk full")

    found = replica(store, "a:1").claim(due("bill", BILL, SLOTS[0]))

    assert (found.send, found.paused) == (set(), {("bill", SLOTS[0])})
    row = controls.run_row(store.statements, BILL, SLOTS[0])
    assert row is not None
    assert (row["state"], row["reason"]) == ("paused", "paused by ann@host: disk full")
    assert replica(store, "b:2").unconfirmed(at_once=True) == []  # never sent, never resent


def test_a_disabled_stored_entry_s_slot_is_recorded_paused_and_its_code_namesake_sent(
    store: Store,
) -> None:
    """A stored entry switched off is paused as a paused one is: its slot claimed, not
    sent, recorded paused with who switched it off. The code's entry of that name is sent."""
    store.seed.disabled(NS, "bill", "web:ann")
    [first] = due("bill", BILL, SLOTS[0])

    found = replica(store, "a:1").claim([first._replace(entry=Entry("bill", "tasks.bill", True))])
    code = replica(store, "a:1").claim(due("bill", BILL, SLOTS[1]))

    assert (found.send, found.paused) == (set(), {("bill", SLOTS[0])})
    row = controls.run_row(store.statements, BILL, SLOTS[0])
    assert row is not None
    assert (row["state"], row["reason"]) == ("paused", "disabled by web:ann")
    assert (code.send, code.paused) == ({("bill", SLOTS[1])}, set())


def test_confirmation_moves_an_entry_s_last_slot_forward_only(store: Store) -> None:
    beat = replica(store, "a:1")
    beat.claim(due("bill", BILL, *SLOTS))

    beat.confirm(due("bill", BILL, SLOTS[1]))
    beat.confirm(due("bill", BILL, SLOTS[0]))  # late: the entry's state stays on the newest

    assert beat.last_slots_sent() == {"bill": SLOTS[1]}


def test_a_claim_never_confirmed_is_taken_over_by_a_new_leader(store: Store) -> None:
    old = replica(store, "a:1")
    old.claim(due("bill", BILL, *SLOTS))
    old.confirm(due("bill", BILL, SLOTS[0]))

    taken = replica(store, "b:2").unconfirmed(at_once=True)

    assert taken == [("bill", SLOTS[1])]
    target = controls.Target(store.statements.tables, NS, "ann@host")
    why = controls.why(store.statements, target, lock_name=BILL, slot=SLOTS[1], entry="bill")
    [send] = why["sends"]
    assert (send["sent_by"], send["sends"], send["sent_at"]) == ("b:2", 2, None)


def test_a_fresh_claim_is_not_taken_over_before_resend_after(store: Store) -> None:
    old = replica(store, "a:1")
    old.claim(due("bill", BILL, SLOTS[0]))

    assert replica(store, "b:2").unconfirmed() == []  # pglock_beat_resend_after: not yet


def test_last_slots_sent_are_this_namespace_s(store: Store) -> None:
    beat = replica(store, "a:1")
    assert beat.last_slots_sent() == {}
    beat.claim(due("bill", BILL, SLOTS[0]))
    beat.confirm(due("bill", BILL, SLOTS[0]))

    assert beat.last_slots_sent() == {"bill": SLOTS[0]}
