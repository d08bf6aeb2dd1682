"""Soak: many slotted jobs, 30 % of them duplicates, through 2 workers of 2 processes each.

``PGLOCK_SOAK_TASKS`` messages (default 1,000 for CI; the issue asks for 10,000, run with
``PGLOCK_SOAK_TASKS=10000``). While they run, the test samples the sessions the workers
hold and the resident memory of their pool processes; every slot must run exactly once,
the session count must not grow, memory must stay flat after warm-up.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.faults.workload import MEASUREMENTS, Invariants, Report, Sent, Workload
from tests.fixtures.procs import Procs, wait_until

# Run alone (serial): its memory bound (RSS growth) and throughput are measured alone, which other
# tests' load would distort.
pytestmark = [pytest.mark.faults, pytest.mark.serial]

TASKS = int(os.environ.get("PGLOCK_SOAK_TASKS", "1000"))
DUPLICATES = 0.3
SLOT = "2026-11-29T18:05:00Z"
WARM_UP = 0.3  # fraction of the slots done before the memory baseline is taken
# kB per pool process, from warm-up to the end. Python grows its heap in 1 MiB arenas, so
# RSS moves in steps: at 1,000 messages (about 50 slots per process before the baseline)
# a process that keeps nothing still steps 0-5 MiB (4.7 MiB seen in CI at a 20 % warm-up).
# This catches a gross leak; PGLOCK_SOAK_TASKS=10000 is the run that measures growth.
RSS_GROWTH_LIMIT = 6 * 1024
POOL_PROCESSES = 4  # 2 workers x 2
SAMPLE_EVERY = 0.25  # seconds


@dataclass
class Sample:
    done: int
    sessions: int
    rss_kb: dict[int, int]


@dataclass
class Run:
    workload: Workload
    sent: list[Sent]
    slots: int
    samples: list[Sample] = field(default_factory=list)
    report: Report = field(default_factory=Report)

    @property
    def procs(self) -> Procs:
        return self.workload.procs


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def sessions(dsn: str) -> int:
    """Sessions celery-pglock opened on this (private) server."""
    query = """
        SELECT count(*) FROM pg_stat_activity
         WHERE application_name LIKE 'celery-pglock%' OR application_name LIKE 'pglock %'
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def executed(w: Workload) -> int:
    rows = w.rows("SELECT count(*) AS n FROM {}", "executions")
    return int(rows[0]["n"])


def messages(w: Workload, tasks: int) -> list[tuple[str, dict[str, Any]]]:
    """``tasks`` (key, options) pairs: 70 % new slots, 30 % copies of earlier ones."""
    rng = random.Random(6)
    keys: list[str] = []
    plan = []
    for _ in range(tasks):
        if keys and rng.random() < DUPLICATES:
            plan.append(rng.choice(keys[-50:]))  # recent: often still running
        else:
            keys.append(w.key("soak"))
            plan.append(keys[-1])
    return [(key, {"via": "lock"}) for key in plan]


@pytest.fixture(scope="module")
def run(redis_url: str, run_pg: EmbeddedPostgres, run_procs: Procs) -> Run:
    """Send everything, sample while it drains, stop, check."""
    w = Workload(
        name="soak", admin_dsn=run_pg.dsn, app_dsn=run_pg.dsn, redis_url=redis_url, procs=run_procs
    )
    w.prepare()
    gc_every = os.environ.get("PGLOCK_SOAK_GC_EVERY", "20")
    workers = [w.worker(name, TEST_GC_EVERY=gc_every) for name in ("s1", "s2")]
    plan = messages(w, TASKS)
    slots = len({key for key, _ in plan})
    started = time.monotonic()
    sent = [s for key, options in plan for s in w.send(key, slot=SLOT, **options)]
    result = Run(w, sent, slots)

    def finished() -> bool:
        w.alive_check()
        pools = [pid for worker in workers for pid in worker.children()]
        done = executed(w)
        result.samples.append(Sample(done, sessions(w.admin_dsn), {p: rss_kb(p) for p in pools}))
        return done >= slots and all(
            s.result.ready() or str(s.result.state) == "SKIPPED" for s in sent[-20:]
        )

    wait_until(finished, timeout=30 + TASKS / 20, interval=SAMPLE_EVERY, message="the soak")
    w.settle(sent, timeout=60)
    seconds = time.monotonic() - started
    MEASUREMENTS[f"soak: {TASKS} messages ({slots} slots) through 2x2 processes, s"] = round(
        seconds, 1
    )
    MEASUREMENTS[f"soak: {TASKS} messages, messages per second"] = round(TASKS / seconds, 1)
    w.stop()
    result.report = w.check()
    return result


def test_each_slot_ran_exactly_once(run: Run) -> None:
    """Every slot ran once, every duplicate was skipped: one SUCCESS per slot."""
    states = [str(s.result.state) for s in run.sent]
    assert [] == run.report.succeeded_twice
    assert (run.slots, len(run.sent) - run.slots) == (
        states.count("SUCCESS"),
        states.count("SKIPPED"),
    )
    assert run.slots == run.report.executions


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""


def test_session_count_stays_constant(run: Run) -> None:
    """The workers' sessions do not grow with the tasks run: one pooled per pool process."""
    counts = [s.sessions for s in run.samples if s.done >= run.slots * WARM_UP]
    MEASUREMENTS["soak: sessions held after warm-up, min"] = min(counts)
    MEASUREMENTS["soak: sessions held after warm-up, max"] = max(counts)
    assert max(counts) <= POOL_PROCESSES


def test_memory_stays_flat(run: Run) -> None:
    """Pool processes do not grow after warm-up (RSS from /proc, lowest per window)."""
    warm = [s for s in run.samples if s.done >= run.slots * WARM_UP]
    early = [s for s in warm if s.done < run.slots * 2 * WARM_UP] or warm[:1]
    late = [s for s in warm if s.done >= run.slots * (1 - WARM_UP)] or warm[-1:]
    growth = {
        pid: min(s.rss_kb[pid] for s in late) - min(s.rss_kb[pid] for s in early)
        for pid in early[0].rss_kb
    }
    MEASUREMENTS["soak: largest RSS growth after warm-up, kB"] = max(growth.values())
    assert [] == [pid for pid, kb in growth.items() if kb > RSS_GROWTH_LIMIT]
