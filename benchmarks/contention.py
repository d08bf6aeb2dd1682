"""Contention: 64 deliveries of one slot across 4 worker processes; exactly one may run.

Each trial publishes 64 messages of ``bench.contended`` (one lock: the task name) carrying
the same ``pglock_slot`` header, then lets a ``celery worker -c 4`` drain them. The body
sleeps 50 ms, so early duplicates find the lock held (``locked``) and later ones the slot
done (``done``). Measured in the worker: ``task_prerun`` to the ``task_skipped`` signal,
which fires after the SKIPPED state is stored in the result backend (Redis). Checked in
PostgreSQL: the slot's ledger row (one attempt, succeeded) and its 63 logged skips.
"""

from __future__ import annotations

from dataclasses import dataclass

import psycopg
from psycopg import sql

from benchmarks import common
from benchmarks.records import BODY_RAN, SKIP_DECIDED
from benchmarks.worker_app import CODES, contended
from benchmarks.workers import BenchWorker, Record, bench_worker

DELIVERIES = 64
PROCESSES = 4


@dataclass
class Trial:
    runs: int
    skips: int
    decisions: list[float]  # seconds from task_prerun to the skip decision
    ledger_attempts: int
    ledger_state: str
    logged_skips: int
    reasons: dict[str, int]


@dataclass
class Result:
    trials: list[Trial]
    load: common.LoadWindow

    @property
    def decisions(self) -> list[float]:
        return [d for t in self.trials for d in t.decisions]


def ledger(dsn: str, schema: str, lock: str, slot: str) -> tuple[int, str, int, dict[str, int]]:
    runs = sql.Identifier(schema, "pglock_runs")
    skips = sql.Identifier(schema, "pglock_skips")
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT attempts, state FROM {} WHERE lock_name = %s AND slot = %s").format(
                runs
            ),
            (lock, slot),
        ).fetchone()
        reasons = conn.execute(
            sql.SQL(
                "SELECT reason, count(*) FROM {} WHERE lock_name = %s AND slot = %s GROUP BY 1"
            ).format(skips),
            (lock, slot),
        ).fetchall()
    attempts, state = row if row else (0, "missing")
    counts = {reason: int(n) for reason, n in reasons}
    return int(attempts), str(state), sum(counts.values()), counts


def trial(worker: BenchWorker, dsn: str, schema: str, prefix: str, number: int) -> Trial:
    slot = f"{common.RUN_ID}-contention-{number}"
    code = CODES["bench.contended"]
    queue = f"{prefix}-contention-{number}"
    for i in range(DELIVERIES):
        contended.apply_async((f"{number}-{i}",), queue=queue, headers={"pglock_slot": slot})
    mark = worker.collector.mark()

    def finished(records: list[Record]) -> bool:
        return sum(1 for r in records if r.kind == 1 and r.contender == code) >= DELIVERIES

    worker.control("add_consumer", queue)
    try:
        records = worker.collector.wait(mark, finished, 120)
    finally:
        worker.control("cancel_consumer", queue)
    mine = [r for r in records if r.contender == code]
    attempts, state, logged, reasons = ledger(dsn, schema, f"{prefix}:bench.contended", slot)
    return Trial(
        runs=sum(1 for r in mine if r.kind == BODY_RAN),
        skips=sum(1 for r in mine if r.kind == SKIP_DECIDED),
        decisions=[r.t1 - r.t0 for r in mine if r.kind == SKIP_DECIDED],
        ledger_attempts=attempts,
        ledger_state=state,
        logged_skips=logged,
        reasons=reasons,
    )


def run(env: dict[str, str], dsn: str, *, trials: int, backend: str) -> Result:
    load = common.LoadWindow()
    results = []
    with bench_worker({**env, "BENCH_RESULT_BACKEND": backend}, PROCESSES) as worker:
        for number in range(trials + 1):
            found = trial(worker, dsn, env["BENCH_SCHEMA"], env["BENCH_PREFIX"], number)
            if number == 0:
                continue  # warm-up: connections, prepared statements
            results.append(found)
            p99 = common.quantile(found.decisions, 0.99)
            print(
                f"  contention trial {number}/{trials}: runs {found.runs}, skips {found.skips}"
                f" {found.reasons}, p99 {common.ms(p99)}",
                flush=True,
            )
    load.close()
    return Result(results, load)
