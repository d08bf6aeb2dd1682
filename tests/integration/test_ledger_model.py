"""A model of the ledger and the locks, checked against a real PostgreSQL step by step.

Hypothesis drives the library's own functions (``acquire``, ``release``, ``sweep_orphans``,
``record_outcome``) across many attempts, each on a connection of its own, over a few lock
names and slots: attempts finish, fail, die (their process killed, or their backend
terminated while the process lives on), freeze past their lease, and the beat leader's
sweep runs between them. After every step the ledger rows and ``pg_locks`` must be what
the reference model below predicts from docs/guarantees.md ("What happens to a message",
"The states of a ledger row").

``PGLOCK_MODEL_EXAMPLES=500 PGLOCK_MODEL_STEPS=40`` explores longer, from a random seed
(``--hypothesis-seed=N`` repeats one); unset, the run is derandomized (the same examples
every time) and short enough for CI.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from celery_pglock._config import Settings
from celery_pglock._heartbeat import heartbeat
from celery_pglock._keys import lock_key, split_key
from celery_pglock._ledger import ABANDONED, FAILED, SUCCEEDED, record_outcome, sweep_orphans
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease, Released
from celery_pglock.errors import LockLost
from celery_pglock.store._database import Database
from celery_pglock.store.statements import OnConnection
from tests.fixtures.pg import fresh_schema
from tests.fixtures.procs import wait_until
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    open_database,
    pick,
    session_alive,
    skip_rows,
    skipped,
)

pytestmark = pytest.mark.integration

RUNNING = "running"
LOCKS = 3  # lock names per machine
SLOTS = ("s0", "s1", "s2")
LEASE = 1.0  # seconds: short, so that a frozen holder is ended within about a second
FROZEN_SESSION_END = LEASE + 10.0  # deadline for the server to end a frozen session
BACKEND_END = 10.0  # deadline for a closed or terminated backend to leave pg_stat_activity
FAIL_REASON = "RuntimeError: boom"

# Unset: CI's bounded, derandomized run. Set: a longer run from a random seed.
LONG_RUN = "PGLOCK_MODEL_EXAMPLES" in os.environ
EXAMPLES = int(os.environ.get("PGLOCK_MODEL_EXAMPLES", "30"))
STEPS = int(os.environ.get("PGLOCK_MODEL_STEPS", "25"))
# Freezes cost about a lease of real time each: a few per example, whatever its length.
FREEZES = int(os.environ.get("PGLOCK_MODEL_FREEZES", "1"))

LIVE = "live"  # its session holds the lock
LOST = "lost"  # its session ended (terminated, or frozen past the lease); the process lives
DEAD = "dead"  # its process died with its session (SIGKILL): it never does anything again
DONE = "done"  # it released (or recovered): it never does anything again

MODEL_SETTINGS = settings(
    max_examples=EXAMPLES,
    stateful_step_count=STEPS,
    deadline=None,
    derandomize=not LONG_RUN,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@dataclass(eq=False)
class Attempt:
    """One execution: its lease (lock, slot, token, connection) and what became of it."""

    lease: Lease
    task_id: str
    backend_pid: int
    status: str = LIVE

    def __repr__(self) -> str:
        lock = self.lock.rsplit(":", 1)[-1]
        return f"<{self.task_id} {lock}/{self.lease.slot} token {self.token} {self.status}>"

    @property
    def lock(self) -> str:
        return self.lease.lock

    @property
    def key(self) -> tuple[str, str]:
        assert self.lease.slot is not None
        return (self.lease.lock, self.lease.slot)

    @property
    def token(self) -> int:
        return self.lease.token


@dataclass
class Row:
    """What the model expects of one ledger row; ``attempt`` is the one whose token it has."""

    state: str
    attempts: int
    attempt: Attempt
    reason: str | None = None

    def expected(self) -> tuple[Any, ...]:
        return (self.state, self.attempt.token, self.attempts, self.attempt.task_id, self.reason)


class LedgerModel(RuleBasedStateMachine):
    """Attempts on a few (lock name, slot) pairs against the ledger's documented states."""

    def __init__(self, dsn: str) -> None:
        super().__init__()
        self._stack = ExitStack()
        schema = self._stack.enter_context(fresh_schema(dsn))
        # One connection per lock holder at most, plus those a lost attempt still has
        # checked out until it releases: never more than one per step, plus a few.
        db_settings = Settings(dsn=dsn, schema=schema, pool_size=STEPS + 8)
        self.db: Database = self._stack.enter_context(open_database(db_settings))
        self.admin = self._stack.enter_context(psycopg.connect(dsn, autocommit=True))
        # Advisory locks are database-wide: names of this machine's schema only.
        self.schema = schema
        self.locks = [f"{schema}:L{i}" for i in range(LOCKS)]
        self.keys = {split_key(lock_key(name)): name for name in self.locks}
        self.attempts: list[Attempt] = []
        self.holders: dict[str, Attempt] = {}  # lock name -> the live attempt holding it
        self.rows: dict[tuple[str, str], Row] = {}
        self.succeeded: dict[tuple[str, str], tuple[int, int]] = {}  # written once
        self.tokens: list[int] = []  # of every grant, in grant order
        # The skip log: (lock, slot, reason, skipped task, who held the lock or ran the slot)
        self.skips: list[tuple[str, str, str, str, str | None]] = []  # None: not compared
        self.freezes = 0
        self.serial = 0

    # -- the model's questions ----------------------------------------------------------

    def draw_attempt(self, data: st.DataObject, attempts: list[Attempt], label: str) -> Attempt:
        """One of ``attempts``, drawn by task id (a failing run prints 'a3', not a lease)."""
        task_id = data.draw(st.sampled_from([a.task_id for a in attempts]), label=label)
        return next(a for a in attempts if a.task_id == task_id)

    def draw_lock(self, data: st.DataObject, names: list[str], label: str) -> str:
        """One of the lock ``names``, drawn by its short name (L0, L1, …)."""
        short = data.draw(st.sampled_from([n.rsplit(":", 1)[1] for n in names]), label=label)
        return f"{self.schema}:{short}"

    def with_status(self, status: str, *, leased: bool = False) -> list[Attempt]:
        return [
            a
            for a in self.attempts
            if a.status == status and (not leased or a.lease.lease_seconds is not None)
        ]

    def has(self, status: str, *, leased: bool = False) -> bool:
        return bool(self.with_status(status, leased=leased))

    def owns_row(self, attempt: Attempt) -> bool:
        """Whether no later attempt claimed the attempt's slot: its token still decides."""
        row = self.rows.get(attempt.key)
        return row is not None and row.attempt is attempt

    def succeeded_rows(self) -> list[Row]:
        return [self.rows[key] for key in sorted(self.succeeded)]

    def orphans(self) -> set[tuple[str, str]]:
        """Rows left running by an attempt whose session is gone."""
        return {k for k, r in self.rows.items() if r.state == RUNNING and r.attempt.status != LIVE}

    def record(self, attempt: Attempt, state: str, reason: str | None) -> None:
        row = self.rows[attempt.key]
        row.state, row.reason = state, reason
        if state == SUCCEEDED:
            self.succeeded[attempt.key] = (attempt.token, row.attempts)

    def session_ended(self, attempt: Attempt, status: str) -> None:
        del self.holders[attempt.lock]
        attempt.status = status

    # -- acquiring ----------------------------------------------------------------------

    def attempt(self, lock: str, slot: str, leased: bool) -> None:
        """Claim (lock, slot) and compare the grant or the skip with the model's answer."""
        self.serial += 1
        task_id = f"a{self.serial}"
        outcome = acquire(self.db, claim(lock, slot, task_id), "session", LEASE if leased else None)
        row = self.rows.get((lock, slot))
        holder = self.holders.get(lock)
        if row is not None and row.state == SUCCEEDED:
            skip = skipped(outcome)
            assert skip.holder is not None
            ran = (skip.reason, skip.token, skip.holder["task_id"])
            assert ("done", row.attempt.token, row.attempt.task_id) == ran
            self.skips.append((lock, slot, "done", task_id, row.attempt.task_id))
            return
        if holder is not None:
            skip = skipped(outcome)
            assert skip.holder is not None
            held = (skip.reason, skip.token, skip.holder["task_id"], skip.holder["slot"])
            assert ("locked", holder.token, holder.task_id, holder.key[1]) == held
            self.skips.append((lock, slot, "locked", task_id, holder.task_id))
            if row is not None and row.state == RUNNING and row.attempt.status != LIVE:
                row.state, row.reason = FAILED, ABANDONED  # the skip finishes the dead one
            return
        lease = granted(outcome)
        assert lease.token > max(self.tokens, default=0), "tokens strictly increase"
        attempts = (row.attempts if row is not None else 0) + 1
        assert attempts == lease.attempts
        new = Attempt(lease, task_id, lease.connection.info.backend_pid)
        self.tokens.append(lease.token)
        self.attempts.append(new)
        self.holders[lock] = new
        self.rows[(lock, slot)] = Row(RUNNING, attempts, new)

    @rule(data=st.data())
    def acquire_any(self, data: st.DataObject) -> None:
        """A claim of any (lock, slot) is granted, or skipped as done or locked, as modelled."""
        lock = self.draw_lock(data, self.locks, "lock")
        slot = data.draw(st.sampled_from(SLOTS), label="slot")
        self.attempt(lock, slot, leased=data.draw(st.booleans(), label="leased"))

    @precondition(lambda self: bool(self.holders))
    @rule(data=st.data())
    def acquire_held_lock(self, data: st.DataObject) -> None:
        """A claim of a lock a live attempt holds is skipped: locked (done if it succeeded)."""
        lock = self.draw_lock(data, sorted(self.holders), "held lock")
        self.attempt(lock, data.draw(st.sampled_from(SLOTS), label="slot"), leased=False)

    @precondition(lambda self: bool(self.succeeded))
    @rule(data=st.data())
    def acquire_succeeded_slot(self, data: st.DataObject) -> None:
        """A claim of a slot that succeeded is skipped as done, naming the run that did it."""
        lock, slot = self.draw_attempt(data, [r.attempt for r in self.succeeded_rows()], "ran").key
        self.attempt(lock, slot, leased=data.draw(st.booleans(), label="leased"))

    @precondition(lambda self: self.has(LOST) or self.has(DEAD))
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """A gone attempt's redelivery re-claims its slot, or its skip fails the dead row."""
        gone = self.with_status(LOST) + self.with_status(DEAD)
        lock, slot = self.draw_attempt(data, gone, "gone").key
        self.attempt(lock, slot, leased=data.draw(st.booleans(), label="leased"))

    # -- live attempts end --------------------------------------------------------------

    def live(self, data: st.DataObject, *, leased: bool = False) -> Attempt:
        return self.draw_attempt(data, self.with_status(LIVE, leased=leased), "live")

    @precondition(lambda self: self.has(LIVE))
    @rule(data=st.data())
    def finish_or_fail(self, data: st.DataObject) -> None:
        """A live attempt's release records succeeded, or failed with its reason, and frees it."""
        attempt = self.live(data)
        succeeded = data.draw(st.booleans(), label="succeeded")
        state, reason = (SUCCEEDED, None) if succeeded else (FAILED, FAIL_REASON)

        released = release(self.db, attempt.lease, state, reason)

        assert Released(recorded=True, lost=False) == released
        self.record(attempt, state, reason)
        self.session_ended(attempt, DONE)

    @precondition(lambda self: self.has(LIVE))
    @rule(data=st.data())
    def check_live(self, data: st.DataObject) -> None:
        """A live attempt's check() asks the server and finds its lock still held."""
        attempt = self.live(data)
        attempt.lease.check()
        assert not attempt.lease.lost

    @precondition(lambda self: self.has(LIVE))
    @rule(data=st.data())
    def kill(self, data: st.DataObject) -> None:
        """A SIGKILLed worker: its lock connection closes unreleased; the lock is free."""
        attempt = self.live(data)
        conn = attempt.lease.connection
        heartbeat().unregister(attempt.lease)  # the process, heartbeat included, is gone
        with conn.lock:  # not under a heartbeat ping in flight
            conn.close()
        self.db.putconn(conn, clean=False)  # a closed one: the pool replaces it
        wait_until(
            lambda: not session_alive(self.admin, attempt.backend_pid),
            timeout=BACKEND_END,
            message=f"the killed attempt's backend {attempt.backend_pid} to end",
        )
        self.session_ended(attempt, DEAD)

    @precondition(lambda self: self.has(LIVE))
    @rule(data=st.data())
    def terminate(self, data: st.DataObject) -> None:
        """pg_terminate_backend of a holder: the lock is free, its process lives on."""
        attempt = self.live(data)
        self.admin.execute("SELECT pg_terminate_backend(%s)", (attempt.backend_pid,))
        wait_until(
            lambda: not session_alive(self.admin, attempt.backend_pid),
            timeout=BACKEND_END,
            message=f"the terminated backend {attempt.backend_pid} to end",
        )
        self.session_ended(attempt, LOST)

    @precondition(lambda self: self.freezes < FREEZES and self.has(LIVE, leased=True))
    @rule(data=st.data(), wakes=st.booleans())
    def freeze(self, data: st.DataObject, wakes: bool) -> None:
        """A holder whose heartbeat stops is ended by the server; awake, check() is LockLost."""
        attempt = self.live(data, leased=True)
        self.freezes += 1
        heartbeat().unregister(attempt.lease)
        wait_until(
            lambda: not session_alive(self.admin, attempt.backend_pid),
            timeout=FROZEN_SESSION_END,
            message=f"the server to end frozen backend {attempt.backend_pid} (its lease)",
        )
        if wakes:  # else it learns at release, without having asked
            with pytest.raises(LockLost):
                attempt.lease.check()
        self.session_ended(attempt, LOST)

    # -- attempts whose session ended, and the sweep ------------------------------------

    @precondition(lambda self: self.has(LOST))
    @rule(data=st.data())
    def lost_attempt_ends(self, data: st.DataObject) -> None:
        """A lost attempt's outcome is recorded iff no later attempt claimed its slot."""
        attempt = self.draw_attempt(data, self.with_status(LOST), "lost")
        succeeded = data.draw(st.booleans(), label="succeeded")
        by_release = data.draw(st.booleans(), label="by release")
        if data.draw(st.booleans(), label="checks first"):
            with pytest.raises(LockLost):
                attempt.lease.check()
        state, reason = (SUCCEEDED, None) if succeeded else (FAILED, FAIL_REASON)
        owns = self.owns_row(attempt)

        if by_release:
            released = release(self.db, attempt.lease, state, reason)
            assert Released(recorded=owns, lost=True) == released
        else:
            recorded = record_outcome(self.db, attempt.lease.claim, attempt.token, state, reason)
            assert owns == recorded
            assert Released(recorded=False, lost=True) == release(self.db, attempt.lease, state)

        if owns:
            self.record(attempt, state, reason)
        attempt.status = DONE

    @precondition(lambda self: bool(self.orphans()))
    @rule()
    def sweep(self) -> None:
        """sweep_orphans fails ('abandoned: …') exactly the running rows whose session is gone."""
        expected = {(k, self.rows[k].attempt.token) for k in self.orphans()}
        with self.db.connection() as conn:
            tables = self.db.tables
            swept = sweep_orphans(OnConnection(conn, tables).rows)
        assert expected == {((r["lock_name"], r["slot"]), r["token"]) for r in swept}
        for key, _token in expected:
            self.rows[key].state, self.rows[key].reason = FAILED, ABANDONED

    # -- checked after every step -------------------------------------------------------

    @invariant()
    def ledger_is_the_model(self) -> None:
        """Every ledger row has the state, token, attempts, task and reason modelled."""
        query = self.db.tables.render(
            "SELECT lock_name, slot, state, token, attempts, task_id, reason FROM {runs}"
        )
        actual = {(r[0], r[1]): tuple(r[2:]) for r in self.admin.execute(query).fetchall()}
        assert {k: r.expected() for k, r in self.rows.items()} == actual

    @invariant()
    def skip_log_is_the_model(self) -> None:
        """Every skip appended one row: its slot, reason, task, and who held or ran it."""
        query = self.db.tables.render(
            "SELECT lock_name, slot, reason, task_id, holder_task_id FROM {skips} ORDER BY id"
        )
        actual = [tuple(r) for r in self.admin.execute(query).fetchall()]
        unchecked = {i for i, skip in enumerate(self.skips) if skip[4] is None}
        assert self.skips == [(*r[:4], None) if i in unchecked else r for i, r in enumerate(actual)]

    @invariant()
    def locks_are_held_by_live_attempts(self) -> None:
        """pg_locks shows each lock held by its live attempt's backend alone, or by none."""
        rows = self.admin.execute(
            "SELECT classid::bigint, objid::bigint, pid FROM pg_locks "
            "WHERE locktype = 'advisory' AND granted AND objsubid = 1"
        ).fetchall()
        actual: dict[str, list[int]] = {}
        for classid, objid, pid in rows:
            name = self.keys.get((classid, objid))
            if name is not None:
                actual.setdefault(name, []).append(pid)
        expected = {name: [a.backend_pid] for name, a in self.holders.items()}
        assert expected == {name: sorted(pids) for name, pids in actual.items()}

    @invariant()
    def one_live_attempt_per_lock(self) -> None:
        """At most one live attempt holds a lock name, and each live attempt holds its own."""
        live = self.with_status(LIVE)
        assert len(live) == len({a.lock for a in live})
        assert {a.lock: a for a in live} == self.holders

    @invariant()
    def succeeded_is_final(self) -> None:
        """A slot that succeeded keeps its run: never claimed again (same token, attempts)."""
        for key, run in self.succeeded.items():
            row = self.rows[key]
            assert (SUCCEEDED, *run) == (row.state, row.attempt.token, row.attempts)

    @invariant()
    def tokens_strictly_increase(self) -> None:
        """Grants got strictly increasing fencing tokens, in grant order."""
        assert sorted(set(self.tokens)) == self.tokens

    @invariant()
    def running_rows_belong_to_their_last_claim(self) -> None:
        """A running row is its live holder's, or a gone attempt's until a sweep or claim."""
        for key, row in self.rows.items():
            if row.state == RUNNING and row.attempt.status == LIVE:
                assert self.holders[key[0]] is row.attempt
            if row.state == RUNNING:
                assert row.attempt.status in (LIVE, LOST, DEAD)

    def teardown(self) -> None:
        """Give back every attempt's connection, close the library, drop the schema."""
        try:
            for attempt in self.attempts:
                heartbeat().unregister(attempt.lease)
                if attempt.status in (LIVE, LOST):
                    with suppress(Exception):  # a failed step may have left it broken
                        release(self.db, attempt.lease, FAILED, "teardown")
        finally:
            self._stack.close()


@pytest.fixture
def lease_server(pg_dsn: str) -> str:
    """``pg_dsn``, skipping the test on a server without idle_session_timeout (< 14)."""
    with psycopg.connect(pg_dsn) as conn:
        if conn.info.server_version < 140000:
            pytest.skip("the lease needs idle_session_timeout (PostgreSQL >= 14)")
    return pg_dsn


@pytest.mark.timeout(max(300, EXAMPLES * STEPS))
def test_ledger_follows_the_model(lease_server: str) -> None:
    """Claims, outcomes, deaths, freezes and sweeps keep the ledger and locks as documented."""
    run_state_machine_as_test(lambda: LedgerModel(lease_server), settings=MODEL_SETTINGS)


# -- fixed sequences the model found --------------------------------------------------------


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    """The library on this test's schema (tables created on open), closed after."""
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


def test_done_skip_while_locked_logs_who_ran_it(db: Database, pg_conn: Conn, job: str) -> None:
    """A done skip while another slot holds the lock logs who ran the slot, as its Skip says."""
    release(db, granted(acquire(db, claim(job, "s0", "t-ran"), "session", None)), SUCCEEDED)
    other = granted(acquire(db, claim(job, "s1", "t-other"), "session", None))

    skip = skipped(acquire(db, claim(job, "s0", "t-late"), "session", None))

    assert skip.holder is not None
    assert ("done", "t-ran") == (skip.reason, skip.holder["task_id"])
    [logged] = skip_rows(pg_conn, db, job)
    assert {"reason": "done", "task_id": "t-late", "holder_task_id": "t-ran"} == pick(
        logged, "reason", "task_id", "holder_task_id"
    )
    release(db, other, SUCCEEDED)
