"""The operator-controls lab: two beat replicas (active-active: each one ticks and claims)
and a worker serving a 1-s entry ``tick``, and the ``celery -A … pglock`` command line run
as an operator types it.

One set of processes for the package's tests (``controls_lab``, on its own schema,
namespace and queue): the tests share its timeline and each waits only for what it needs.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row

from tests.acceptance.beat_support import APP, prepare_schema
from tests.apps.harness import app_env
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import Procs, wait_until

PASSWORD = "N0tPr1nted"  # noqa: S105 - trust auth ignores it; it must never be printed
DEADLINE = 60.0
ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT = 60


@dataclass
class Lab:
    """The module's processes and a way to ask the database and run the CLI."""

    env: dict[str, str]
    admin_dsn: str
    schema: str

    def cli(self, *args: str) -> tuple[int, str]:
        """``celery -A tests.apps.testapp pglock *args``: exit status and output."""
        argv = [sys.executable, "-m", "celery", "-A", APP, "pglock", *args]
        done = subprocess.run(
            argv,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT,
            check=False,
        )
        output = done.stdout + done.stderr
        assert PASSWORD not in output
        return done.returncode, output

    def rows(self, query: str, table: str, **params: Any) -> list[dict[str, Any]]:
        composed = sql.SQL(query).format(sql.Identifier(self.schema, table))
        with (
            psycopg.connect(self.admin_dsn, autocommit=True) as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return cur.execute(composed, params).fetchall()

    def runs(self, state: str | None = None) -> list[dict[str, Any]]:
        rows = self.rows("SELECT * FROM {} WHERE entry = 'tick' ORDER BY slot", "pglock_runs")
        return [row for row in rows if state is None or row["state"] == state]

    def executed(self) -> list[str]:
        return [r["slot"] for r in self.rows("SELECT slot FROM {} ORDER BY id", "executions")]

    def sends_since(self, moment: datetime) -> list[dict[str, Any]]:
        query = "SELECT * FROM {} WHERE claimed_at >= %(t)s ORDER BY slot"
        return self.rows(query, "pglock_beat_sends", t=moment)


@pytest.fixture(scope="package")
def controls_lab(
    pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    schema = f"t_controls_{uuid.uuid4().hex[:8]}"
    prepare_schema(pg_dsn, schema)
    app_dsn = make_conninfo(pg_dsn, password=PASSWORD)
    env = app_env(
        pg_dsn=app_dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_NAMESPACE=schema,
        TEST_BEAT_EVERY="1",
        TEST_BEAT_LEADER="0",
    )
    procs = Procs(tmp_path_factory.mktemp("controls"), cwd=ROOT)
    yield from serving(Lab(env, pg_dsn, schema), procs, ["-c", "2"], beats=2)


def serving(lab: Lab, procs: Procs, worker_args: list[str], *, beats: int) -> Iterator[Lab]:
    """Start a worker and ``beats`` beat replicas on the lab's schema; yield the lab once
    two slots ran; stop them all and drop the schema afterwards."""
    try:
        procs.celery(APP, "worker", *worker_args, "-l", "info", env=lab.env, name="worker")
        for n in range(beats):
            procs.celery(APP, "beat", "-l", "info", env=lab.env, name=f"beat-{n}")
        wait_until(lambda: len(lab.executed()) >= 2, timeout=DEADLINE, message="2 ticks")
        yield lab
    finally:
        procs.stop_all()
        drop_schema(lab.admin_dsn, lab.schema)


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def held_back(lab: Lab, count: int) -> list[str]:
    """Pause ``tick`` until ``count`` slots were held back, resume; those slots."""
    assert 0 == lab.cli("pause", "tick")[0]
    paused = utcnow()

    def held() -> list[str]:
        return [r["slot"] for r in lab.runs("paused") if r["scheduled_at"] > paused]

    slots = wait_until(lambda: len(held()) >= count and held(), timeout=DEADLINE, message="held")
    assert 0 == lab.cli("resume", "tick")[0]
    return slots
