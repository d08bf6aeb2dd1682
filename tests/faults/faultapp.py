"""The fault workload's tasks, on the shared acceptance app (``tests.apps.testapp``).

Run as ``celery -A tests.faults.faultapp worker|beat``: the app is ``testapp.app``, configured
from the same environment (``TEST_SCHEMA``, ``TEST_NAMESPACE``, ``TEST_BEAT_EVERY``…), with
these tasks added. Every body records its execution (task id, lock name, slot, fencing
token, pid) in ``<schema>.executions`` and returns its fencing token, so the checker can tie
a ``SUCCESS`` result to one execution and one ledger row.

Gates are files: a faulted PostgreSQL must not open them (an advisory-lock gate would open
when the server restarts), so a gated body waits until the test creates the file.
"""

from __future__ import annotations

import gc
import itertools
import os
import time
from pathlib import Path
from typing import Any

import psycopg
from celery import signals
from psycopg import sql

from celery_pglock import PgLockTask, fence
from celery_pglock._config import app_settings
from celery_pglock.store._database import database
from tests.apps import testapp
from tests.apps.testapp import app, finish, record

__all__ = ["app"]

NAMESPACE = os.environ.get("TEST_NAMESPACE", "testapp")
GATE_TIMEOUT = 60.0  # seconds: a gate the test forgot fails the task instead of hanging
GATE_POLL = 0.02

INSERT_DONE_SQL = (
    "INSERT INTO {} (task, task_id, lock_name, slot, token, pid, marker, finished) "
    "VALUES (%s, %s, %s, %s, %s, %s, %s, clock_timestamp())"
)


def job_lock(key: Any, **_: Any) -> str:
    """One lock per job key, inside the test's namespace."""
    return f"{NAMESPACE}:job:{key}"


def raw_key(key: Any, **_: Any) -> Any:
    """The key as given (bad-input tests); ``{"raise": text}`` raises instead."""
    if isinstance(key, dict) and "raise" in key:
        raise ValueError(key["raise"])
    return key


def raw_slot(slot: Any = None, **_: Any) -> Any:
    """The slot as given (bad-input tests); ``{"raise": text}`` raises instead."""
    if isinstance(slot, dict) and "raise" in slot:
        raise LookupError(slot["raise"])
    return slot


def wait_for_file(gate: str | None) -> None:
    """Block until the test creates the file ``gate`` (None: do not wait)."""
    if gate is None:
        return
    deadline = time.monotonic() + GATE_TIMEOUT
    while not Path(gate).exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} was never opened")
        time.sleep(GATE_POLL)


def record_done(task: Any, marker: str | None = None) -> None:
    """One finished execution row, written on the lock's own connection."""
    lease = task.pglock
    values = (task.name, task.request.id, lease.lock, lease.slot, lease.token, os.getpid(), marker)
    query = sql.SQL(INSERT_DONE_SQL).format(testapp.table("executions"))
    lease.connection.execute(query, values)


if int(os.environ.get("TEST_GC_EVERY") or 0) > 0:
    # Celery's trace keeps each Ignore (every SKIPPED message) in a reference cycle with
    # billiard's copy of the traceback (~100 kB): only the cyclic collector frees it. The
    # soak collects every N tasks so that RSS shows what is really kept.
    every = int(os.environ["TEST_GC_EVERY"])
    finished = itertools.count(1)

    @signals.task_postrun.connect(weak=False)
    def collect_cycles(**_: Any) -> None:
        if next(finished) % every == 0:
            gc.collect()


@app.task(bind=True, base=PgLockTask, name="faults.job", pglock_key=job_lock)
def job(self: Any, key: str, hold: float = 0.0, gate: str | None = None, via: str = "own") -> int:
    """Record (own connection, or ``via="lock"`` once at the end), wait, return the token.

    ``via="early"``: the execution is recorded finished before the wait, so that the body
    touches no database afterwards (a failover test lets PostgreSQL go meanwhile)."""
    if via == "early":
        finish(record(self))
        wait_for_file(gate)
        return int(self.pglock.token)
    if via == "lock":
        wait_for_file(gate)
        time.sleep(hold)
        record_done(self)
        return int(self.pglock.token)
    row = record(self)
    wait_for_file(gate)
    time.sleep(hold)
    finish(row)
    return int(self.pglock.token)


@app.task(bind=True, base=PgLockTask, name="faults.fenced_job", pglock_key=job_lock)
def fenced_job(self: Any, key: str, gate: str | None = None) -> int:
    """Record, wait, then write through ``fence()`` on the job's resource: a holder that
    was superseded meanwhile fails with ``StaleToken``."""
    row = record(self)
    wait_for_file(gate)
    with psycopg.connect(testapp.DSN) as conn, conn.transaction():
        fence(conn, f"resource:{key}", self.pglock.token)
    finish(row)
    return int(self.pglock.token)


@app.task(
    bind=True,
    base=PgLockTask,
    name="faults.job_tx",
    pglock_key=job_lock,
    pglock_scope="transaction",
)
def job_tx(
    self: Any, key: str, hold: float = 0.0, gate: str | None = None, via: str = "lock"
) -> int:
    """Transaction scope: the execution row commits with the ledger row, or not at all.

    ``via="first"``: record first, then wait for the gate and return without another
    statement (a test may end the session meanwhile: only the commit then finds out).
    ``via="fail"``: wait for the gate, then raise without a statement (only the rollback
    then meets the lock's connection).
    """
    if via == "first":
        record_done(self)
        wait_for_file(gate)
        return int(self.pglock.token)
    if via == "fail":
        wait_for_file(gate)
        raise RuntimeError("asked to fail after the gate")
    wait_for_file(gate)
    time.sleep(hold)
    record_done(self)
    return int(self.pglock.token)


@app.task(name="faults.warm_pool")
def warm_pool(connections: int) -> int:
    """Check out ``connections`` of this process's pooled connections at once, give them back.

    A pool grown like this under load keeps them, idle, for the next tasks.
    """
    db = database(app_settings(app))
    held = [db.getconn() for _ in range(connections)]
    for conn in held:
        db.putconn(conn, clean=True)
    return len(held)


@app.task(bind=True, base=PgLockTask, name="faults.periodic")
def periodic(self: Any) -> int:
    """The beat entry's task (``TEST_BEAT_TASK=faults.periodic``)."""
    finish(record(self))
    return int(self.pglock.token)


@app.task(bind=True, base=PgLockTask, name="faults.raw", pglock_key=raw_key, pglock_slot=raw_slot)
def raw(self: Any, key: Any, slot: Any = None) -> int:
    """Lock name and slot exactly as the caller gave them (bad input)."""
    record_done(self)
    return int(self.pglock.token)
