"""``pglock_scope="transaction"`` under a real prefork worker: the task's writes and its
ledger row commit, or roll back, together.

Each test gets its own schema, queue and lock namespace, and asserts on what the task
wrote (``executions``, written on ``self.pglock.connection``) and on the run ledger.
"""

from __future__ import annotations

import psycopg
import pytest

from tests.apps import testapp
from tests.apps.harness import (
    Gate,
    configure_client,
    executions,
    ledger,
    redis_app_env,
    start_workers,
)
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

SLOT = "2026-11-29"
SLOTTED = {"pglock_slot": SLOT}
DEADLINE = 30.0  # seconds; generous, the machine runs other suites meanwhile


def start(redis_url: str, pg_dsn: str, schema: str, procs: Procs) -> None:
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        redis_url=redis_url,
    )
    configure_client(env)
    start_workers(procs, env, 1)


def in_transaction(dsn: str, task_id: str) -> bool:
    """Whether the holder of ``task_id`` (named in application_name) has a transaction open."""
    query = (
        "SELECT 1 FROM pg_stat_activity WHERE application_name LIKE %s AND xact_start IS NOT NULL"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, (f"pglock % {task_id} %",)).fetchone() is not None


def test_failing_run_rolls_back_its_writes_and_records_the_failure(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """A run that raises leaves none of its writes, and a 'failed' ledger row."""
    start(redis_url, pg_dsn, pglock_schema, procs)

    result = testapp.work_tx.apply_async((0.0, True, "doomed"), headers=SLOTTED)

    with pytest.raises(RuntimeError, match="asked to fail"):
        result.get(timeout=DEADLINE)
    assert executions(pg_dsn, pglock_schema) == []
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("failed", 1, result.id) == (run["state"], run["attempts"], run["task_id"])
    assert "asked to fail" in run["reason"]


def test_succeeding_run_commits_its_writes_with_the_ledger(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """A run's writes and its 'succeeded' ledger row are invisible until they commit together."""
    start(redis_url, pg_dsn, pglock_schema, procs)

    with Gate(pg_dsn) as gate:
        result = testapp.gated_tx.apply_async((gate.id, "kept"), headers=SLOTTED)
        wait_until(
            lambda: in_transaction(pg_dsn, result.id),
            timeout=DEADLINE,
            message="the run inside its transaction",
        )
        uncommitted = (executions(pg_dsn, pglock_schema), ledger(pg_dsn, pglock_schema))

    token = result.get(timeout=DEADLINE)
    assert uncommitted == ([], [])
    [row] = executions(pg_dsn, pglock_schema)
    assert (row["task_id"], row["token"], row["marker"]) == (result.id, token, "kept")
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 1, token) == (run["state"], run["attempts"], run["token"])
