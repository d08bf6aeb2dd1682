"""``celery-pglock demo`` end to end: real beat and worker processes, judged by its JSON report.

Short runs (a few seconds of measuring, 2 beats, 1 worker); each costs ~15-20 s, most of
it Celery starting and stopping over the polling PostgreSQL broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.acceptance

ROOT = Path(__file__).resolve().parents[2]
SHORT = ("--duration", "6", "--beats", "2", "--workers", "1", "--concurrency", "3")
RUN_TIMEOUT = 120.0


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``python -m celery_pglock demo *args`` to completion."""
    argv = [sys.executable, "-m", "celery_pglock", "demo", *args]
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=RUN_TIMEOUT, cwd=ROOT, check=False
    )


def report_of(result: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert result.stdout.strip(), f"no report; stderr:\n{result.stderr}"
    report: dict[str, Any] = json.loads(result.stdout)
    return report


def test_demo_with_lock_on_embedded_postgres_runs_each_slot_once() -> None:
    """Default path (embedded PostgreSQL as lock store and broker): every slot ran exactly once."""
    result = demo(*SHORT, "--json", "--seed", "11")

    report = report_of(result)
    assert (0, True) == (result.returncode, report["ok"]), result.stderr
    [run] = report["runs"]
    totals = run["totals"]
    assert run["lock"] is True
    assert totals["slots_due"] >= 6
    assert 0 == totals["double_executions"]
    assert 0 == totals["missed_slots"]
    assert totals["executions"] > 0
    assert {"slots_sent": totals["slots_due"], "slots_sent_again": 0} == {
        key: run["beat"][key] for key in ("slots_sent", "slots_sent_again")
    }
    assert {1} == {stats["max_parallel"] for stats in run["tasks"].values()}


def test_demo_without_lock_runs_slots_more_than_once(pg_dsn: str, pglock_schema: str) -> None:
    """Stock Celery with 2 beats: slots run twice; that is no failure of the demo (exit 0)."""
    result = demo(*SHORT, "--without-lock", "--json", "--dsn", pg_dsn, "--schema", pglock_schema)

    report = report_of(result)
    assert (0, True) == (result.returncode, report["ok"]), result.stderr
    [run] = report["runs"]
    assert run["lock"] is False
    assert run["totals"]["double_executions"] > 0
    assert run["totals"]["slots_run_twice"] > 0


def test_demo_stops_every_process_on_sigterm(
    pg_dsn: str, pglock_schema: str, tmp_path: Path
) -> None:
    """SIGTERM mid-run: the demo stops its beats and workers, says so and exits 130."""
    stderr = tmp_path / "demo.err"
    argv = [sys.executable, "-m", "celery_pglock", "demo", *SHORT[2:], "--duration", "120"]
    argv += ["--dsn", pg_dsn, "--schema", pglock_schema]
    with stderr.open("w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
    try:
        wait_until(lambda: executions(pg_dsn, pglock_schema), timeout=60, message="a task run")
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)

        assert 130 == proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    wait_until(lambda: not any(alive(pid) for pid in family), timeout=5, message="no leftover")
    assert "interrupted; every process was stopped" in stderr.read_text()
    assert len(family) >= 3  # two beats and a worker (and its pool) were running


def executions(dsn: str, schema: str) -> int:
    query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "demo_executions"))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(query).fetchone()
    except psycopg.errors.UndefinedTable:
        return 0
    return int(row[0]) if row else 0


def descendants(pid: int) -> list[int]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    found, pending = [], list(tree.get(pid, []))
    while pending:
        child = pending.pop()
        found.append(child)
        pending.extend(tree.get(child, []))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (ProcessLookupError, FileNotFoundError):
        return False
    return state != "Z"
