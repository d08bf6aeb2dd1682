"""The beat leader makes final the ledger rows a dead attempt left ``running``.

A worker SIGKILLed mid-run leaves its slot's row ``running``; if no redelivery ever claims
the slot (the message was acked, or a newer slot superseded it), nothing else would end
it. A real ``celery beat`` leader finds such a row within its sweep interval.
"""

from __future__ import annotations

import pytest

from celery_pglock._config import Settings
from celery_pglock._locks import acquire
from tests.apps.harness import app_env
from tests.fixtures.procs import Procs, wait_until
from tests.integration.locking import (
    Conn,
    claim,
    granted,
    lock_holders,
    open_database,
    terminate,
    the_run,
)

pytestmark = pytest.mark.acceptance

SLOT = "2026-12-01T09:00:00Z"
DEADLINE = 30.0  # seconds: the sweep runs every 10 s; the machine runs other suites meanwhile


def test_beat_leader_records_a_dead_attempts_running_row_failed(
    procs: Procs, pg_dsn: str, pglock_schema: str, redis_url: str, pg_conn: Conn
) -> None:
    """A running row whose session is gone becomes failed ("abandoned: …") within the
    leader's sweep interval, with no message for its slot ever arriving."""
    env = app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        broker_url=redis_url,
        TEST_NAMESPACE=pglock_schema,
        TEST_BEAT_EVERY="3600",
    )
    beat = procs.celery("tests.apps.testapp", "beat", "-l", "info", env=env, name="beat")
    beat.wait_for_log("is now the leader", timeout=DEADLINE)
    name = f"{pglock_schema}:job"
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as db:
        dead = granted(acquire(db, claim(name, SLOT, "t-dead"), "session", None))
        [backend] = lock_holders(pg_conn, name)
        terminate(pg_conn, backend)

        row = wait_until(
            lambda: (run := the_run(pg_conn, db, name, SLOT))["state"] == "failed" and run,
            timeout=DEADLINE,
            message="the leader to record the dead attempt failed",
        )

    assert (dead.token, True) == (row["token"], row["reason"].startswith("abandoned:"))
    beat.wait_for_log("recorded failed, its session is gone")
