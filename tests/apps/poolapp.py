"""``tests.apps.testapp`` plus a task that holds its own lock for a while, for the pool tests.

Run as ``celery -A tests.apps.poolapp worker -P <pool>``: the app is ``testapp.app``,
configured from the same environment, with one more task; ``TEST_POOL_SIZE`` sets
``pglock_pool_size`` (unset: the default, "auto").
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from celery_pglock import PgLockTask
from tests.apps import testapp
from tests.apps.testapp import GATE_CLASS, app, finish, record

__all__ = ["app", "burst", "hold"]

GATE_POLL = 0.05  # seconds between two looks at the gate
GATE_DEADLINE = 60.0  # a gate the test forgot fails the task instead of hanging the worker

if os.environ.get("TEST_POOL_SIZE"):
    app.conf.pglock_pool_size = int(os.environ["TEST_POOL_SIZE"])


def by_key(key: str, *_: Any, **__: Any) -> str:
    """``pglock_key`` of ``hold``: its first argument."""
    return key


def wait_for_open_gate(gate: int) -> None:
    """Poll until the test opens ``gate`` (``harness.Gate``), sleeping in between.

    Not ``testapp.wait_for_gate``'s blocking lock wait: under eventlet psycopg's wait
    does not yield, and one blocked statement would stop every task of the worker.
    """
    deadline = time.monotonic() + GATE_DEADLINE
    with psycopg.connect(testapp.DSN, autocommit=True) as conn:
        query = "SELECT pg_try_advisory_lock_shared(%s, %s)"
        while not conn.execute(query, (GATE_CLASS, gate)).fetchone()[0]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"gate {gate} still closed after {GATE_DEADLINE:g} s")
            time.sleep(GATE_POLL)  # green under gevent/eventlet: other tasks run meanwhile


@app.task(bind=True, base=PgLockTask, name="poolapp.hold", pglock_key=by_key)
def hold(self: Any, key: str, seconds: float = 1.0, gate: int | None = None) -> Any:
    """Locked on ``key``: record, keep the lock ``seconds`` and until ``gate`` opens (if
    given), finish; return the fencing token."""
    row = record(self)
    time.sleep(seconds)
    if gate is not None:
        wait_for_open_gate(gate)
    finish(row)
    return self.pglock.token


@app.task(bind=True, base=PgLockTask, name="poolapp.burst", pglock_key=by_key, pglock_slot=by_key)
def burst(self: Any, key: str, seconds: float = 1.0) -> Any:
    """Locked on ``key``, its run recorded in the ledger under slot ``key``: keep the lock
    ``seconds`` and return the fencing token. It opens no connection of its own (a test
    of the server's connection budget counts the library's alone)."""
    time.sleep(seconds)
    return self.pglock.token
