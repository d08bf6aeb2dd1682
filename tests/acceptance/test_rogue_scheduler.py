"""A stock ``celery beat`` left running beside a PgLockScheduler replica: the worker says so,
once per task and hour, naming the sender, and ``celery pglock status`` shows it; a call
marked ``pglock_adhoc=True`` is not taken for one."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.beat_support import APP, prepared_schema
from tests.apps import testapp
from tests.apps.harness import app_env, configure_broker_client
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

DEADLINE = 60.0
WARNING = "a message without a slot from"


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    with prepared_schema(pg_dsn, "t_rogue") as name:
        yield name


def rows(dsn: str, query: str, schema: str, table: str) -> list[tuple[Any, ...]]:
    composed = sql.SQL(query).format(sql.Identifier(schema, table))
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(composed).fetchall()


def slotless_runs(dsn: str, schema: str) -> int:
    return len(rows(dsn, "SELECT id FROM {} WHERE slot IS NULL", schema, "executions"))


def test_a_stock_beat_beside_the_replicas_is_reported_once_and_shown_by_status(
    pg_dsn: str, redis_url: str, schema: str, procs: Procs, tmp_path: Path
) -> None:
    env = app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_NAMESPACE=schema,
        TEST_BEAT_EVERY="1",
    )
    worker = procs.celery(APP, "worker", "--pool=solo", "-l", "info", env=env, name="worker")
    procs.celery(APP, "beat", "-l", "info", env=env, name="beat")
    wait_until(
        lambda: rows(pg_dsn, "SELECT * FROM {}", schema, "pglock_beat_tasks"),
        timeout=DEADLINE,
        message="the leader to say which tasks it sends",
    )
    configure_broker_client(env)
    testapp.tick.apply_async(pglock_adhoc=True)  # a deliberate call: not a stock beat's
    wait_until(lambda: slotless_runs(pg_dsn, schema) == 1, timeout=DEADLINE, message="ad hoc")
    assert WARNING not in worker.log_text()

    stock_env = {**env, "TEST_BEAT_SCHEDULER": "celery.beat:PersistentScheduler"}
    shelve = f"--schedule={tmp_path / 'stock-schedule'}"
    procs.celery(APP, "beat", "-l", "info", shelve, env=stock_env, name="stock-beat")

    wait_until(lambda: WARNING in worker.log_text(), timeout=DEADLINE, message="the warning")
    seen = slotless_runs(pg_dsn, schema)
    wait_until(
        lambda: slotless_runs(pg_dsn, schema) >= seen + 3,
        timeout=DEADLINE,
        message="3 more messages of the stock beat",
    )
    assert 1 == worker.log_text().count(WARNING)  # once per task and hour
    [line] = [text for text in worker.log_text().splitlines() if WARNING in text]
    assert "testapp.tick" in line
    assert "@" in line.split(WARNING, 1)[1].split()[0]  # the sender: gen<pid>@<host>
    argv = [sys.executable, "-m", "celery", "-A", APP, "pglock", "status"]
    status = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    assert 0 == status.returncode, status.stderr
    assert "SLOT-LESS MESSAGES OF SCHEDULED TASKS" in status.stdout
    assert "testapp.tick" in status.stdout.split("SLOT-LESS", 1)[1]
