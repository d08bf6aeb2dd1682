"""A worker process whose tasks run as threads keeps its session-scope locks on one
shared session (``celery_pglock._shared`` on ``store.shared_sessions``), on the in-memory
server and on PostgreSQL alike: one session holds every run's lock, the process keeps two
runs of one lock apart itself, a done slot frees only what its try took, and a session
that ends loses every lock on it and none of the next run's."""

from __future__ import annotations

import pytest

from celery_pglock._runs import settle_success
from celery_pglock.errors import LockLost
from tests.contract.lives import LATER, SLOT, Lifecycle, granted, skipped

NEXT = "2026-12-07T10:02:00Z"


def test_runs_of_the_process_hold_their_locks_on_one_session(shared_life: Lifecycle) -> None:
    """Two runs, two slots: both locks live on one session; each release frees its own,
    and after the last one no lock is held."""
    first = granted(shared_life.take(shared_life.claim(SLOT)))
    second = granted(shared_life.take(shared_life.claim(LATER, concurrency=2)))

    assert first.lock_session is second.lock_session
    settle_success(shared_life.db, first)
    assert shared_life.locks_held() > 0  # the second run's lock is still held
    settle_success(shared_life.db, second)
    assert 0 == shared_life.locks_held()


def test_a_second_run_of_a_held_lock_is_skipped_naming_the_run_of_the_process(
    shared_life: Lifecycle,
) -> None:
    """The session would take the lock again (advisory locks are re-entrant): the process
    skips the second run itself, as locked, naming its own run."""
    holder = granted(shared_life.take(shared_life.claim(SLOT, task_id="holder")))

    skip = skipped(shared_life.take(shared_life.claim(LATER, task_id="second")))

    assert ("locked", "holder") == (skip.reason, (skip.holder or {}).get("task_id"))
    assert (holder.token, ["locked"]) == (
        skip.token,
        [row["reason"] for row in shared_life.skips(LATER)],
    )
    settle_success(shared_life.db, holder)


def test_a_done_slot_frees_only_what_its_try_took(shared_life: Lifecycle) -> None:
    """A late copy of a succeeded slot takes the lock on the shared session and gives it
    back at once: the lock another run of the process holds stays held."""
    settle_success(shared_life.db, granted(shared_life.take(shared_life.claim(SLOT))))
    running = granted(shared_life.take(shared_life.claim(LATER, concurrency=2)))
    held = shared_life.locks_held()

    late = skipped(shared_life.take(shared_life.claim(SLOT, concurrency=2)))

    assert ("done", held) == (late.reason, shared_life.locks_held())
    settle_success(shared_life.db, running)
    assert 0 == shared_life.locks_held()


def test_an_ended_session_loses_every_lock_on_it_and_the_next_run_gets_a_new_one(
    shared_life: Lifecycle,
) -> None:
    """The shared session ends: both runs on it learn they lost their lock, their
    outcomes are still recorded (nobody took their slots over), and the next run's lock
    lives on a new session."""
    first = granted(shared_life.take(shared_life.claim(SLOT)))
    second = granted(shared_life.take(shared_life.claim(LATER, concurrency=2)))
    shared_life.server.end(first)

    with pytest.raises(LockLost):
        first.check()
    for lost in (first, second):
        settle_success(shared_life.db, lost)
    again = granted(shared_life.take(shared_life.claim(NEXT)))

    assert (True, True) == (first.known_lost, second.known_lost)
    assert ["succeeded"] * 2 == [shared_life.run(slot)["state"] for slot in (SLOT, LATER)]
    assert again.lock_session is not first.lock_session
    settle_success(shared_life.db, again)
    assert 0 == shared_life.locks_held()
