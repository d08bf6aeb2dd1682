"""A run's lifecycle through the library's own code (``locks.acquire``, ``runs.settle_*``,
``waiting``), on the in-memory server and on PostgreSQL alike: claim, skip, settle, give
back, ``pglock_concurrency``, ``buffer_one``'s turn, a lock lost to a terminated session
or a frozen holder's lease, and an operator's release of a held lock."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery

from celery_pglock import _waiting as waiting
from celery_pglock._messages import SLOT_HEADER
from celery_pglock._runs import settle_failure, settle_success
from celery_pglock._waiting import WAITED_HEADER, Message
from celery_pglock.errors import LockLost
from celery_pglock.steering import actions
from celery_pglock.steering._operator import Operator
from tests.contract.lives import LATER, LEASE, SLOT, Lifecycle, granted, pick, skipped
from tests.fixtures.procs import wait_until


def test_a_claim_is_granted_with_a_token_and_its_row_running(life: Lifecycle) -> None:
    """The first claim of a slot gets the lock, attempt 1 and a token; its row is running."""
    lease = granted(life.take(life.claim(task_id="first")))

    assert (1, "running", "first") == (lease.attempts, *pick(life.run(), "state", "task_id"))
    assert lease.token == life.run()["token"]
    settle_success(life.db, lease)


def test_a_claim_of_a_held_lock_is_skipped_naming_the_holder(life: Lifecycle) -> None:
    """A second claim while the lock is held is skipped as locked, naming the holder."""
    holder = granted(life.take(life.claim(task_id="holder")))

    skip = skipped(life.take(life.claim(LATER, task_id="second")))

    assert ("locked", "holder") == (skip.reason, (skip.holder or {}).get("task_id"))
    assert ["locked"] == [row["reason"] for row in life.skips(LATER)]
    settle_success(life.db, holder)


def test_a_succeeded_slot_is_done_for_every_later_message(life: Lifecycle) -> None:
    """Settled succeeded, the slot's row is final: a late duplicate is skipped as done."""
    settle_success(life.db, granted(life.take(life.claim(task_id="ran"))))

    skip = skipped(life.take(life.claim(task_id="late copy")))

    assert "succeeded" == life.run()["state"]
    assert ("done", "ran") == (skip.reason, (skip.holder or {}).get("task_id"))


def test_a_failed_attempt_does_not_burn_the_slot(life: Lifecycle) -> None:
    """Settled failed, the slot runs again: attempt 2, with a larger token."""
    first = granted(life.take(life.claim()))
    settle_failure(life.db, first, RuntimeError("disk full"))
    assert ("failed", "RuntimeError: disk full") == pick(life.run(), "state", "reason")

    again = granted(life.take(life.claim()))

    assert 2 == again.attempts
    assert again.token > first.token
    settle_success(life.db, again)
    assert "succeeded" == life.run()["state"]


def test_a_released_lock_is_given_back_free(life: Lifecycle) -> None:
    """After each settle the lock is free and no lock stays held by a pooled session
    (a mutex's release is sent without waiting for it: free once the server reads it)."""
    settle_success(life.db, granted(life.take(life.claim(SLOT))))
    settle_failure(life.db, granted(life.take(life.claim(LATER))), ValueError("bad"))
    settle_success(life.db, granted(life.take(life.claim(None))))

    wait_until(lambda: life.locks_held() == 0, message="every lock of the test's name freed")
    assert ["succeeded", "failed"] == [life.run(slot=s)["state"] for s in (SLOT, LATER)]


def test_concurrency_n_runs_n_slots_and_never_one_slot_twice(life: Lifecycle) -> None:
    """Under pglock_concurrency = 2 two slots run at once, a third waits its turn (locked),
    and a second message of a running slot is skipped, not run under the other key."""
    first = granted(life.take(life.claim(SLOT, concurrency=2)))
    copy = skipped(life.take(life.claim(SLOT, concurrency=2)))
    second = granted(life.take(life.claim(LATER, concurrency=2)))
    third = skipped(life.take(life.claim("2026-12-07T10:02:00Z", concurrency=2)))

    assert first.claim.key != second.claim.key
    assert ("locked", "locked") == (copy.reason, third.reason)
    settle_success(life.db, first)
    settle_success(life.db, second)
    assert 0 == life.locks_held()


def test_a_terminated_holder_learns_of_it_and_a_takeover_wins(life: Lifecycle) -> None:
    """The holder's session ends: a redelivery takes the slot over (a larger token); the
    old holder's success cannot stand (LockLost) and the row keeps the new attempt."""
    old = granted(life.take(life.claim(task_id="old")))
    life.server.end(old)
    new = granted(life.take(life.claim(task_id="new")))

    with pytest.raises(LockLost):
        settle_success(life.db, old)

    assert new.token > old.token
    assert (new.token, "running") == pick(life.run(), "token", "state")
    settle_success(life.db, new)
    assert ("succeeded", "new") == pick(life.run(), "state", "task_id")


def test_a_terminated_holder_still_records_its_outcome_when_nobody_took_over(
    life: Lifecycle,
) -> None:
    """The session ends at the end of the run and nobody claimed the slot since: the
    outcome is recorded on a fresh session, the lease marked lost."""
    lease = granted(life.take(life.claim()))
    life.server.end(lease)

    settle_success(life.db, lease)

    assert lease.known_lost
    assert (lease.token, "succeeded") == pick(life.run(), "token", "state")


def test_a_frozen_holder_loses_its_lock_within_the_lease(life: Lifecycle) -> None:
    """A holder that stops answering loses the lock when its lease runs out: another
    claim gets it, and the holder, asked, knows it lost it."""
    frozen = granted(life.take(life.claim(task_id="frozen"), lease=LEASE))
    life.server.freeze(frozen)

    taker = granted(life.take(life.claim(LATER, task_id="taker"), lease=LEASE))

    with pytest.raises(LockLost):
        frozen.check()
    settle_success(life.db, taker)
    settle_success(life.db, frozen)  # nobody took its slot over: its outcome is kept
    assert "succeeded" == life.run()["state"]


def test_transaction_scope_failure_rolls_back_and_records_the_attempt(life: Lifecycle) -> None:
    """Transaction scope: the failed body's claim rolls back with it, and the attempt is
    written again as failed, so the slot may run again."""
    lease = granted(life.take(life.claim(), "transaction"))

    settle_failure(life.db, lease, RuntimeError("boom"))

    assert ("failed", lease.token) == pick(life.run(), "state", "token")
    again = granted(life.take(life.claim(), "transaction"))
    settle_success(life.db, again)
    assert ("succeeded", again.token) == pick(life.run(), "state", "token")


class Sent:
    """What ``waiting.send_next`` publishes, written down (the Celery app's ``send_task``)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, str, Any]] = []

    def send_task(self, name: str, *, task_id: str, headers: dict[str, Any], **_: Any) -> None:
        self.messages.append((task_id, headers[SLOT_HEADER], headers[WAITED_HEADER]))


MESSAGE = Message("tasks.report", [1], {"to": "ops"}, "json", exchange=None, routing_key=None)
NEWEST = "2026-12-07T10:02:00Z"


def test_buffer_one_keeps_one_slot_waiting_and_sends_it_when_the_lock_is_freed(
    life: Lifecycle,
) -> None:
    """buffer_one: a message that finds the lock held is not skipped but waits (its row
    `waiting`); a newer slot takes its place (the older one skipped as superseded, naming
    the newer message); the holder's release sends the waiting message, which then runs."""
    holder = granted(life.take(life.claim(SLOT, task_id="holder")))
    first = life.claim(LATER, task_id="first", buffer=True)
    assert "locked" == skipped(life.take(first)).reason
    assert [] == life.skips(LATER)  # waits: nothing logged as skipped

    decided = waiting.decide(life.db, first, MESSAGE)
    assert ("waiting", None) == (decided.outcome, decided.other_slot)
    assert "waiting" == life.run(LATER)["state"]

    newer = life.claim(NEWEST, task_id="newer", buffer=True)
    skipped(life.take(newer))
    replaced = waiting.decide(life.db, newer, MESSAGE)
    assert (LATER, "first") == replaced.replaced
    assert ("skipped", "superseded") == pick(life.run(LATER), "state", "reason")
    assert "newer" == waiting.replaced_meanwhile(life.db, first)

    settle_success(life.db, holder)
    sent = Sent()
    waiting.send_next(life.db, sent, life.lock)
    assert [("newer", NEWEST, True)] == sent.messages

    turn = granted(life.take(newer))
    assert waiting.forget(life.db, turn.claim)
    settle_success(life.db, turn)
    assert "succeeded" == life.run(NEWEST)["state"]


def test_buffer_one_supersedes_at_once_a_slot_older_than_the_waiting_one(life: Lifecycle) -> None:
    """A slot older than the one already waiting does not wait: superseded, final."""
    holder = granted(life.take(life.claim(SLOT, task_id="holder")))
    waiting.decide(life.db, life.claim(NEWEST, task_id="newest", buffer=True), MESSAGE)

    older = waiting.decide(life.db, life.claim(LATER, task_id="older", buffer=True), MESSAGE)

    assert ("superseded", NEWEST, "newest") == (
        older.outcome,
        older.other_slot,
        older.other_task_id,
    )
    assert ["superseded"] == [row["reason"] for row in life.skips(LATER)]
    settle_success(life.db, holder)


def test_an_operator_s_release_ends_the_holder_s_session_audited(life: Lifecycle) -> None:
    """``celery pglock release`` (``steering.actions.release``): the holder's session is
    ended, the lock is free, the holder learns it lost it, and the audit trail says who."""
    holder = granted(life.take(life.claim(task_id="stuck")))
    app = Celery("contract", set_as_current=False)
    app.conf.update(pglock_dsn="postgresql://nobody@127.0.0.1:9/unused", pglock_namespace="ops")
    op = Operator(app, "ann@host", "contract", opener=life.operator)

    done = actions.release(op, life.lock, any_namespace=True)

    assert (True, ["stuck"]) == (done.released, [h["task_id"] for h in done.terminated])
    assert 0 == life.locks_held()
    with pytest.raises(LockLost):
        holder.check()
    params = {"namespace": "ops", "entry": life.lock, "lock_name": life.lock}
    with life.operator() as statements:
        trail = statements.rows("web_audit", params | {"limit": 10, "offset": 0})
    assert [("release", "ann@host")] == [(row["action"], row["actor"]) for row in trail]
