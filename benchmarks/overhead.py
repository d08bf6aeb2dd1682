"""Per-task overhead in a real ``celery worker`` (prefork, concurrency 2, Redis broker).

Contenders run interleaved: every round runs one batch of each, in an order rotated per
round, so slow phases of the shared machine hit every contender alike. Per batch:

- *publish*: harness time to publish the batch (celery-once and celery-singleton lock
  here, in Redis; we do nothing at publish);
- *service*: in the worker process, ``task_prerun`` to ``task_postrun`` (our
  ``__call__`` wrapper, the body, celery-once's and celery-singleton's unlock);
- *drain*: first start to last end over the batch, divided by its size (throughput of
  the two processes, broker and acknowledgements included);
- *CPU*: CPU time the batch cost the worker processes, their PostgreSQL backends and the
  publishing thread (``benchmarks.cpu``), per task.

The floor tasks are plain tasks whose body issues the same SQL as ours, bare, on one
connection per worker process: their cost above ``plain`` is the floor of ours.
A separate, untimed pass counts round trips per task through a counting proxy.
"""

from __future__ import annotations

import collections
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks import common
from benchmarks.roundtrips import CountingProxy
from benchmarks.worker_app import CONTENDERS, Floor
from benchmarks.workers import Batch, BenchWorker, bench_worker

# Every contender of the worker app but the contention task, which sleeps.
TIMED = tuple(name for name in CONTENDERS if name != "contended")
LOCKED = ("session_mutex", "session_slot", "transaction_slot")
FLOOR_OF = {
    "session_mutex": "floor_mutex",
    "session_slot": "floor_slot",
    "transaction_slot": "floor_transaction",
}
# Publish exactly like plain: their median is the baseline of publishing cost in a round.
PLAIN_PUBLISH = tuple(name for name in TIMED if name not in ("once", "singleton"))
CPU_PARTS = ("worker", "postgres", "redis", "publish")
# Waited round trips: a mutex-only run waits for its acquire only.
MINIMUM_TRIPS = {"session_mutex": 1, "floor_mutex": 1, "session_slot": 2, "transaction_slot": 2}
UNWAITED_LABEL = "SELECT pg_advisory_unlock_all(), set_config("  # the release sent unwaited


@dataclass
class Round:
    batches: dict[str, Batch] = field(default_factory=dict)

    def service(self, contender: str) -> float:
        return statistics.median(self.batches[contender].service)

    def publish(self, contender: str) -> float:
        batch = self.batches[contender]
        return batch.publish / batch.n

    def drain(self, contender: str) -> float:
        batch = self.batches[contender]
        return batch.drain / batch.n

    def cpu(self, contender: str) -> float:
        """CPU seconds per task: worker processes, their PostgreSQL sessions, the publisher."""
        return self.batches[contender].cpu_per_task

    def cpu_extra(self, contender: str) -> float:
        return self.cpu(contender) - self.cpu("plain")

    def publish_base(self) -> float:
        """Publishing cost of a task that does nothing at publish (median of those)."""
        return statistics.median(self.publish(name) for name in PLAIN_PUBLISH)

    def worker_extra(self, contender: str) -> float:
        """Worker-side time above plain, per task."""
        return self.service(contender) - self.service("plain")

    def publish_extra(self, contender: str) -> float:
        return self.publish(contender) - self.publish_base()

    def total_extra(self, contender: str) -> float:
        """Publish plus worker-side time above plain, per task."""
        return self.worker_extra(contender) + self.publish_extra(contender)


@dataclass
class Result:
    rounds: list[Round]
    per_batch: int
    harness_floor: dict[str, list[float]]
    trips: dict[str, dict[str, float]]
    load: common.LoadWindow

    def values(self, metric: str, contender: str) -> list[float]:
        return [getattr(r, metric)(contender) for r in self.rounds]

    def pair(self, numerator: str, denominator: str, metric: str = "service") -> list[float]:
        return [
            getattr(r, metric)(numerator) / getattr(r, metric)(denominator) for r in self.rounds
        ]

    def floor_ratio(self, contender: str) -> list[float]:
        floor = FLOOR_OF[contender]
        return [r.worker_extra(contender) / r.worker_extra(floor) for r in self.rounds]


def run_rounds(worker: BenchWorker, rounds: int, per_batch: int) -> list[Round]:
    for contender in TIMED:  # warm-up: pools, prepared statements, imports
        worker.run(contender, min(per_batch, 60))
    results = []
    for number in range(rounds):
        current = Round()
        for contender in common.rotate_list(TIMED, number):
            current.batches[contender] = worker.run(contender, per_batch)
        results.append(current)
        plain, mutex = current.service("plain"), current.service("session_mutex")
        print(
            f"  round {number + 1}/{rounds}: plain {common.us(plain)}, "
            f"session_mutex {common.us(mutex)}, load {common.load_average()[0]:.2f}",
            flush=True,
        )
    return results


def harness_floor(dsn: str, schema: str, n: int) -> dict[str, list[float]]:
    """The floor statements from one connection in this process, serially (µs per task)."""
    floor = Floor(dsn, schema)
    calls: dict[str, Callable[[int], None]] = {
        "floor_mutex": lambda i: floor.session(f"h{i}", None, "harness"),
        "floor_slot": lambda i: floor.session(f"hs{time.time_ns()}-{i}", "s", "harness"),
        "floor_transaction": lambda i: floor.transaction(f"ht{time.time_ns()}-{i}", "s", "h"),
        "floor_minimal": lambda i: floor.minimal(f"hm{i}"),
    }
    timings: dict[str, list[float]] = collections.defaultdict(list)
    for _ in range(3):
        for name, call in calls.items():
            start = time.perf_counter()
            for i in range(n):
                call(i)
            timings[name].append((time.perf_counter() - start) / n)
    if floor.conn is not None:
        floor.conn.close()
    return dict(timings)


def count_round_trips(env: dict[str, str], dsn: str, n: int) -> dict[str, dict[str, float]]:
    """Round trips per task, by what they carried, through a counting proxy (untimed)."""
    info = _host_port(dsn)
    proxy = CountingProxy(*info)
    trips: dict[str, dict[str, float]] = {}
    try:
        with bench_worker({**env, "PGLOCK_DSN": proxy.dsn(dsn)}, observer_dsn=dsn) as worker:
            for contender in (*LOCKED, *FLOOR_OF.values(), "floor_minimal"):
                worker.run(contender, 20)  # warm-up: prepared statements
                proxy.reset()
                worker.run(contender, n)
                counted = proxy.snapshot()
                per_task = {label: count / n for label, count in counted.most_common()}
                trips[contender] = per_task
                print(f"  round trips, {contender}: {sum(per_task.values()):.2f}", flush=True)
    finally:
        proxy.close()
    return trips


def _host_port(dsn: str) -> tuple[str, int]:
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415

    params = conninfo_to_dict(dsn)
    return str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432)


def run(env: dict[str, str], dsn: str, *, rounds: int, per_batch: int) -> Result:
    load = common.LoadWindow()
    with bench_worker(env) as worker:
        results = run_rounds(worker, rounds, per_batch)
    floor = harness_floor(dsn, env["BENCH_SCHEMA"], per_batch)
    trips = count_round_trips(env, dsn, min(per_batch, 200))
    load.close()
    return Result(results, per_batch, floor, trips, load)
