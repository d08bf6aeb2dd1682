"""Freshness against real processes: a beat entry whose task fails every time goes overdue
``pglock_overdue_after`` seconds after its first slot fell due; the beat leader fires
``task_overdue`` and logs one WARNING for that slot, and ``celery pglock status`` lists the
entry first."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock._slots import parse_slot
from tests.acceptance.beat_support import APP, prepared_schema
from tests.apps import testapp
from tests.apps.harness import app_env
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

OVERDUE_AFTER = 2.0
DEADLINE = 60.0


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    with prepared_schema(pg_dsn, "t_fresh") as name:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            overdue = sql.Identifier(name, "overdue")
            conn.execute(sql.SQL(testapp.OVERDUE_SQL).format(overdue=overdue))
        yield name


def overdue_rows(dsn: str, schema: str) -> list[dict[str, Any]]:
    query = sql.SQL("SELECT * FROM {} ORDER BY at").format(sql.Identifier(schema, "overdue"))
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(query).fetchall()


def executions(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT id FROM {}").format(sql.Identifier(schema, "executions"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchall()


def test_an_entry_failing_every_time_goes_overdue_once_and_status_lists_it_first(
    pg_dsn: str, redis_url: str, schema: str, procs: Procs
) -> None:
    env = app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_NAMESPACE=schema,
        TEST_BEAT_EVERY="1",
        TEST_BEAT_TASK="testapp.always_fails",
        TEST_OVERDUE_AFTER=str(OVERDUE_AFTER),
        TEST_RECORD_OVERDUE="1",
    )
    procs.celery(APP, "worker", "--pool=solo", "-l", "info", env=env, name="worker")
    beat = procs.celery(APP, "beat", "-l", "info", env=env, name="beat")

    [fired] = wait_until(
        lambda: overdue_rows(pg_dsn, schema), timeout=DEADLINE, message="task_overdue"
    )

    deadline = parse_slot(fired["slot"]) + timedelta(seconds=OVERDUE_AFTER)
    assert fired["at"] >= deadline  # never early
    assert fired["overdue_seconds"] > 0
    print(f"task_overdue fired {(fired['at'] - deadline).total_seconds():.2f} s after the deadline")
    argv = [sys.executable, "-m", "celery", "-A", APP, "pglock", "status"]
    status = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    assert 0 == status.returncode, status.stderr
    first_section = status.stdout.split("\n\n")[1]
    assert first_section.startswith("FRESHNESS (1 overdue of 1 watched)")
    assert fired["slot"] in first_section
    ran = len(executions(pg_dsn, schema))
    wait_until(
        lambda: len(executions(pg_dsn, schema)) >= ran + 3,
        timeout=DEADLINE,
        message="3 more slots (3 more looks by the leader)",
    )
    assert 1 == beat.log_text().count("is overdue")  # one warning for that slot
    assert [fired["slot"]] == [r["slot"] for r in overdue_rows(pg_dsn, schema)]
