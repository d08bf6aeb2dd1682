"""Connections and memory over 10,000 locked tasks, with two beat replicas standing by.

A ``celery worker -c 2`` runs ``bench.session_slot`` (session scope, ledger) 10,000 times
while two ``celery beat`` replicas (``PgLockScheduler``, leader election) run beside it.
A sampler reads, every 50 ms, the PostgreSQL sessions each process owns (our sessions
carry the process id in ``application_name``) and the resident memory of every worker
process. Expected: one connection per worker process (as many as concurrent locked
executions), one per beat replica (the leader's lock, a standby's wait), none left over.
"""

from __future__ import annotations

import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from benchmarks import common
from benchmarks.workers import BenchWorker, bench_worker

SAMPLE_EVERY = 0.05
SESSIONS_SQL = "SELECT application_name FROM pg_stat_activity WHERE datname = current_database()"


@dataclass
class Sample:
    at: float
    worker_connections: int
    beat_connections: int
    rss_kib: dict[int, int]


@dataclass
class Result:
    tasks: int
    samples: list[Sample]
    idle_after: int  # worker connections once the run is over (pool idle)
    after_stop: int  # connections of any sampled process after everything stopped
    beat_replicas: int
    concurrency: int
    load: common.LoadWindow
    rss_start: dict[int, int] = field(default_factory=dict)
    rss_end: dict[int, int] = field(default_factory=dict)

    @property
    def peak_worker(self) -> int:
        return max((s.worker_connections for s in self.samples), default=0)

    @property
    def peak_beat(self) -> int:
        return max((s.beat_connections for s in self.samples), default=0)


class Sampler:
    """Background sampling of connections per process group and RSS of worker processes."""

    def __init__(self, dsn: str, worker: BenchWorker, beat_pids: list[int]) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.worker = worker
        self.beat_pids = set(beat_pids)
        self.samples: list[Sample] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def count(self) -> tuple[int, int]:
        worker_pids = {self.worker.proc.pid, *self.worker.pool_pids}
        owners = [common.owner(row[0]) for row in self.conn.execute(SESSIONS_SQL).fetchall()]
        return sum(1 for p in owners if p in worker_pids), sum(
            1 for p in owners if p in self.beat_pids
        )

    def _run(self) -> None:
        while not self.stopping.is_set():
            worker, beat = self.count()
            rss = {pid: common.rss_kib(pid) for pid in self.worker.pool_pids}
            self.samples.append(Sample(time.monotonic(), worker, beat, rss))
            self.stopping.wait(SAMPLE_EVERY)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()


def start_beats(env: dict[str, str], logs: Path, replicas: int) -> list[subprocess.Popen[bytes]]:
    beat_env = {
        **env,
        "BENCH_NAMESPACE": f"{env['BENCH_PREFIX']}-res",
        "BENCH_QUEUE": f"{env['BENCH_PREFIX']}-res-beat",
        "BENCH_EVERY": "1",
    }
    argv = common.celery("-A", "benchmarks.beat_app", "beat", "-l", "WARNING")
    return [common.start_process(argv, logs / f"beat-{i}.log", beat_env) for i in range(replicas)]


def run(
    env: dict[str, str], dsn: str, *, tasks: int, replicas: int = 2, batch: int = 1000
) -> Result:
    load = common.LoadWindow()
    with tempfile.TemporaryDirectory(prefix="pglockbench-beat-") as logs:
        beats = start_beats(env, Path(logs), replicas)
        beat_pids = [proc.pid for proc in beats]
        try:
            with bench_worker(env) as worker:
                worker.run("session_slot", 200)  # warm-up: pool, prepared statements
                time.sleep(1.0)
                rss_start = {pid: common.rss_kib(pid) for pid in worker.pool_pids}
                with Sampler(dsn, worker, beat_pids) as sampler:
                    for _ in range(tasks // batch):
                        worker.run("session_slot", batch)
                time.sleep(1.0)
                rss_end = {pid: common.rss_kib(pid) for pid in worker.pool_pids}
                idle_after = sampler.count()[0]
                pids = {worker.proc.pid, *worker.pool_pids, *beat_pids}
        finally:
            for proc in beats:
                common.stop_process(proc)
    time.sleep(0.5)
    after_stop = sum(1 for p in _owners(dsn) if p in pids)
    load.close()
    return Result(
        tasks=tasks,
        samples=sampler.samples,
        idle_after=idle_after,
        after_stop=after_stop,
        beat_replicas=replicas,
        concurrency=2,
        load=load,
        rss_start=rss_start,
        rss_end=rss_end,
    )


def _owners(dsn: str) -> list[int | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [common.owner(row[0]) for row in conn.execute(SESSIONS_SQL).fetchall()]
