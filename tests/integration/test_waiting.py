"""``pglock_overlap = "buffer_one"`` on PostgreSQL: which slot waits, and what it leaves."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore
from psycopg.rows import dict_row

from celery_pglock import SKIPPED
from celery_pglock import _turns as turns
from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._waiting import (
    ABANDON_PARAMS,
    MAX_SENDS,
    Message,
    Waiting,
    decide,
    forget,
    take_turn,
)
from celery_pglock.store._database import Database
from tests.integration.locking import Conn, claim, open_database, skip_rows, the_run

pytestmark = pytest.mark.integration

SLOTS = [f"2026-11-29T18:0{i}:00Z" for i in range(5)]
MESSAGE = Message("tests.locked", [1, "a"], {"k": 2}, "json", "celery", "celery")
# A real Celery app on kombu's in-memory transport: where a holder's send goes here.
APP = Celery("waiting-tests", broker="memory://", set_as_current=False)


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    # Room for eight messages deciding at once ("auto" depends on what ran before).
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=10)) as database:
        yield database


def buffered(name: str, slot: str) -> Claim:
    return dataclasses.replace(claim(name, slot), buffer=True)


@dataclass(frozen=True)
class Turn:
    """What the task's path came to, and the waiting slot it replaced."""

    outcome: Lease | Skip | Waiting
    replaced: tuple[str, str] | None = None


def wait_turn(db: Database, attempt: Claim) -> Turn:
    """The task's path for a message that found its lock held: decide, then take its turn."""
    decision = decide(db, attempt, MESSAGE)
    outcome = take_turn(db, APP, attempt, decision, scope="session", lease_seconds=None)
    return Turn(outcome, decision.replaced)


def arrive(db: Database, attempt: Claim) -> Turn:
    """What the task does: acquire; if `locked`, wait its turn; if granted, the slot
    waits no more."""
    outcome = acquire(db, attempt, "session", None)
    if isinstance(outcome, Skip) and outcome.reason == "locked":
        return wait_turn(db, attempt)
    if isinstance(outcome, Lease):
        forget(db, attempt)
    return Turn(outcome)


def holding(turn: Turn) -> Lease:
    """The lease of a turn that got the lock."""
    assert isinstance(turn.outcome, Lease), f"expected the lock, got {turn.outcome!r}"
    return turn.outcome


def waiting_rows(conn: Conn, db: Database) -> list[dict[str, Any]]:
    query = db.tables.render("SELECT * FROM {waiting} ORDER BY lock_name")
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query).fetchall()


def test_the_newest_slot_waits_and_replaces_the_one_before(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """Slots 1, 2, 3 arrive while 0 runs: each waits and supersedes the one before; the
    ledger says so, the skip log names the replacing message, a `locked` try is not logged."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    attempts = [buffered(job, slot) for slot in SLOTS[1:4]]
    turns = [arrive(db, attempt) for attempt in attempts]

    assert all(isinstance(turn.outcome, Waiting) for turn in turns)
    replaced = [turn.replaced for turn in turns]
    assert [None, (SLOTS[1], attempts[0].task_id), (SLOTS[2], attempts[1].task_id)] == replaced
    states = [the_run(pg_conn, db, job, slot)["state"] for slot in SLOTS[1:4]]
    assert ["skipped", "skipped", "waiting"] == states
    skips = [(s["slot"], s["reason"], s["holder_task_id"]) for s in skip_rows(pg_conn, db, job)]
    assert [
        (SLOTS[1], "superseded", attempts[1].task_id),
        (SLOTS[2], "superseded", attempts[2].task_id),
    ] == skips
    [kept] = waiting_rows(pg_conn, db)
    assert (SLOTS[3], attempts[2].task_id, None) == (kept["slot"], kept["task_id"], kept["sent_at"])
    release(db, holder, SUCCEEDED)


def test_an_older_time_slot_never_replaces_a_newer_waiting_one(
    db: Database, pg_conn: Conn, job: str
) -> None:
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    newer = buffered(job, SLOTS[3])
    assert isinstance(arrive(db, newer).outcome, Waiting)

    older = arrive(db, buffered(job, SLOTS[1])).outcome

    assert isinstance(older, Skip)
    assert ("superseded", newer.task_id) == (older.reason, (older.holder or {})["task_id"])
    assert [SLOTS[3]] == [row["slot"] for row in waiting_rows(pg_conn, db)]
    release(db, holder, SUCCEEDED)


def test_a_lock_freed_while_the_slot_decided_to_wait_runs_it_at_once(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The holder ended between the first try and the waiting row: the message's second
    try gets the lock, takes its row back and runs (nothing waits on a free lock)."""
    attempt = buffered(job, SLOTS[1])

    turn = wait_turn(db, attempt)  # the lock is free

    lease = holding(turn)
    assert [] == waiting_rows(pg_conn, db)
    assert "running" == the_run(pg_conn, db, job, SLOTS[1])["state"]
    release(db, lease, SUCCEEDED)


def test_messages_that_wait_at_once_leave_one_waiting_slot(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """Eight messages decide at once: one waits, seven are superseded, none is lost."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    attempts = [buffered(job, f"business-key-{n}") for n in range(8)]
    turns: list[Any] = [None] * len(attempts)

    def decide(number: int) -> None:
        turns[number] = arrive(db, attempts[number]).outcome

    threads = [threading.Thread(target=decide, args=(n,)) for n in range(len(attempts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)

    [kept] = waiting_rows(pg_conn, db)
    states = {a.slot: the_run(pg_conn, db, job, str(a.slot))["state"] for a in attempts}
    assert 1 == list(states.values()).count("waiting")
    assert "waiting" == states[kept["slot"]]
    assert {"skipped"} == {s for slot, s in states.items() if slot != kept["slot"]}
    release(db, holder, SUCCEEDED)


def test_a_waiting_slot_that_never_starts_is_given_up_and_final(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """Sent 10 times, never started (its task registered nowhere): the sweep gives it up,
    its ledger row becomes `failed`, final."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    assert isinstance(arrive(db, buffered(job, SLOTS[1])).outcome, Waiting)
    release(db, holder, SUCCEEDED)
    stale = db.tables.render(
        "UPDATE {waiting} SET sends = %(n)s, sent_at = now() - interval '1 hour'"
    )
    pg_conn.execute(stale, {"n": MAX_SENDS})

    given_up = pg_conn.execute(db.tables.query("abandon_waiting"), ABANDON_PARAMS).fetchall()

    assert [(job, SLOTS[1])] == [(row[0], row[1]) for row in given_up]
    row = the_run(pg_conn, db, job, SLOTS[1])
    assert ("failed", ABANDON_PARAMS["reason"]) == (row["state"], row["reason"])
    assert [] == waiting_rows(pg_conn, db)


def test_a_slot_that_replaced_another_then_ran_itself_says_whom_it_replaced(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """D6 (chaos seed 8383), whose message stayed WAITING for good. Slot 1 waits; the
    holder ends (its send not yet made); slot 2 decides to wait,
    replacing slot 1, and its second try gets the lock: it runs, and its turn still
    names slot 1's message, so that the task marks that one SKIPPED."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    first = buffered(job, SLOTS[1])
    assert isinstance(arrive(db, first).outcome, Waiting)
    release(db, holder, SUCCEEDED)  # the lock is free, slot 1 still waits

    turn = wait_turn(db, buffered(job, SLOTS[2]))

    assert isinstance(turn.outcome, Lease)
    assert (SLOTS[1], first.task_id) == turn.replaced
    assert ("skipped", "superseded") == tuple(
        the_run(pg_conn, db, job, SLOTS[1])[key] for key in ("state", "reason")
    )
    release(db, turn.outcome, SUCCEEDED)


def test_a_waiting_slot_whose_own_message_runs_it_is_not_reported_replaced(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """D7 (chaos seed 8383, run again). Slot 1 waits; its message comes back (a retry, not
    the copy) and runs once the lock is free; slot 2 then waits: slot 1 runs, it is not
    superseded, and nobody marks its message SKIPPED."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    first = buffered(job, SLOTS[1])
    assert isinstance(arrive(db, first).outcome, Waiting)
    release(db, holder, SUCCEEDED)
    rerun = holding(arrive(db, first))  # its retry: same task id, no pglock_waited header

    turn = arrive(db, buffered(job, SLOTS[2]))

    assert isinstance(turn.outcome, Waiting)
    assert None is turn.replaced
    assert "running" == the_run(pg_conn, db, job, SLOTS[1])["state"]
    release(db, rerun, SUCCEEDED)


def test_a_slot_that_replaces_another_starts_its_own_count_of_sends(
    db: Database, pg_conn: Conn, job: str
) -> None:
    """The sends of a replaced slot (towards being given up) are not the new one's."""
    holder = holding(arrive(db, buffered(job, SLOTS[0])))
    assert isinstance(arrive(db, buffered(job, SLOTS[1])).outcome, Waiting)
    pg_conn.execute(db.tables.render("UPDATE {waiting} SET sends = 9"))

    assert isinstance(arrive(db, buffered(job, SLOTS[2])).outcome, Waiting)

    [row] = waiting_rows(pg_conn, db)
    assert (SLOTS[2], 0) == (row["slot"], row["sends"])
    release(db, holder, SUCCEEDED)


def test_a_slot_replaced_before_it_said_it_waits_ends_skipped(
    db: Database, pglock_schema: str
) -> None:
    """D10 (chaos, seed 7): slot 1 decides to wait, slot 2 replaces it 12 ms later and
    marks it ``SKIPPED``, and only then does slot 1's ``WAITING`` reach the result
    backend: slot 1's result must end ``SKIPPED`` (``superseded``), not ``WAITING`` for
    good."""
    app = Celery("d10", broker="memory://", backend="cache+memory://", set_as_current=False)

    @app.task(name="tests.d10", shared=False)
    def task() -> None: ...

    name = f"{pglock_schema}:d10"
    holder = holding(arrive(db, claim(name, SLOTS[0])))
    first = dataclasses.replace(buffered(name, SLOTS[1]), task_id="t-first")
    second = dataclasses.replace(buffered(name, SLOTS[2]), task_id="t-second")
    waits = wait_turn(db, first).outcome
    assert isinstance(waits, Waiting)
    replaced = wait_turn(db, second).replaced
    assert ("t-first" == replaced[1]) if replaced else False
    task.push_request(id="t-second")
    try:
        turns.report_replaced(task, replaced, second)  # what slot 2's message does
    finally:
        task.pop_request()

    task.push_request(id="t-first")
    try:
        with pytest.raises(Ignore):
            turns.report_waiting(task, db, first, waits)  # slot 1's message, late
    finally:
        task.pop_request()
    release(db, holder, SUCCEEDED)

    result = app.AsyncResult("t-first")
    assert (SKIPPED, "superseded") == (result.state, result.info["reason"])
    app.close()
