"""SIGKILLed beat standbys leave nothing behind on the server.

A standby waits for leadership inside ``pg_advisory_lock``; a backend blocked there does
not notice on its own that its client died. Left behind it is a leaked connection and a
dead waiter queued for leadership (granted, it would hold the leader lock for a process
that no longer exists). Each round starts a standby beside a running leader, waits until
its backend waits for the lock, SIGKILLs it, and polls until that backend is gone.
"""

from __future__ import annotations

import os
import socket

import psycopg
import pytest

from celery_pglock import lock_key
from tests.apps.harness import app_env
from tests.fixtures.procs import Procs, wait_until

# Run alone (serial): it kills standbys in a row, each a beat that starts in about 2 s.
# GONE_WITHIN is a guarantee, not a speed: a dead waiter's backend stops waiting "within about
# a second" (client_connection_check_interval = 1 s, docs/guarantees.md, Faults), and 5 s
# keeps that documented bound with room that a loaded machine does not use up.
pytestmark = [pytest.mark.faults, pytest.mark.serial]

# Standbys killed in a row: 8 in `make test` (each starts a beat, about 2 s);
# PGLOCK_STANDBY_ROUNDS=50 for a longer look.
ROUNDS = int(os.environ.get("PGLOCK_STANDBY_ROUNDS", "8"))
GONE_WITHIN = 5.0  # seconds: the documented "about a second", with room for load
START_TIMEOUT = 30.0  # seconds; generous, the machine runs other suites meanwhile


def standby_backends(dsn: str, pid: int) -> list[tuple[int, str | None]]:
    """(backend pid, wait event) of the leadership waits opened by beat process ``pid``."""
    name = f"celery-pglock beat standby {pid}@{socket.gethostname()}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid, wait_event FROM pg_stat_activity WHERE application_name = %s",
            (name,),
        ).fetchall()
    return [(int(backend), event) for backend, event in rows]


def test_a_killed_standby_beat_leaves_no_backend_waiting(
    procs: Procs, pg_dsn: str, pglock_schema: str, redis_url: str
) -> None:
    """ROUNDS times: a SIGKILLed standby's backend, blocked in pg_advisory_lock, is gone
    within a few seconds (client_connection_check_interval on waiting connections)."""
    env = app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        broker_url=redis_url,
        TEST_NAMESPACE=pglock_schema,
        TEST_BEAT_EVERY="3600",
    )
    leader = procs.celery("tests.apps.testapp", "beat", "-l", "info", env=env, name="beat-0")
    leader.wait_for_log("is now the leader", timeout=START_TIMEOUT)

    for number in range(1, ROUNDS + 1):
        standby = procs.celery(
            "tests.apps.testapp", "beat", "-l", "info", env=env, name=f"beat-{number}"
        )
        wait_until(
            lambda standby=standby: (
                ("advisory",) in [(event,) for _, event in standby_backends(pg_dsn, standby.pid)]
            ),
            timeout=START_TIMEOUT,
            message=f"standby {number} to wait for leadership (wait event advisory)",
        )
        standby.kill()

        wait_until(
            lambda standby=standby: not standby_backends(pg_dsn, standby.pid),
            timeout=GONE_WITHIN,
            message=f"the backend of killed standby {number} to end",
        )
    assert leader.alive


WAITER = """
import sys
from celery_pglock import advisory_lock

with advisory_lock(sys.argv[1], dsn=sys.argv[2], schema=sys.argv[3], wait=True):
    pass
"""


def waiting_backends(dsn: str, pid: int) -> list[str | None]:
    """Wait events of the connections process ``pid`` opened (``application_name``)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT wait_event FROM pg_stat_activity WHERE application_name LIKE %s",
            (f"celery-pglock% {pid}@%",),
        ).fetchall()
    return [event for (event,) in rows]


def test_a_killed_advisory_lock_waiter_leaves_no_backend_waiting(
    procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """``advisory_lock(wait=True)`` killed while queued: its backend ends within seconds."""
    job = f"{pglock_schema}:job"
    with psycopg.connect(pg_dsn, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (lock_key(job),))
        waiter = procs.python("-c", WAITER, job, pg_dsn, pglock_schema, name="waiter")
        wait_until(
            lambda: "advisory" in waiting_backends(pg_dsn, waiter.pid),
            timeout=START_TIMEOUT,
            message="the waiter to queue for the lock",
        )
        waiter.kill()

        wait_until(
            lambda: "advisory" not in waiting_backends(pg_dsn, waiter.pid),
            timeout=GONE_WITHIN,
            message="the killed waiter's backend to stop waiting",
        )
