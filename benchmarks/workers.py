"""Drive a real ``celery worker`` running ``benchmarks.worker_app`` from the harness.

``Collector`` reads the records worker processes write to a FIFO. ``BenchWorker``
starts the worker, publishes a batch into a fresh queue while the worker does not
consume it, then lets the worker drain it (``add_consumer``) and waits for every
record: publishing and executing are timed apart, and nothing else runs meanwhile.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from benchmarks import common, cpu
from benchmarks.records import RECORD
from benchmarks.worker_app import CODES, app


@dataclass(frozen=True)
class Record:
    kind: int
    contender: int
    pid: int
    t0: float
    t1: float


class Collector:
    """Every record written to the FIFO, in arrival order."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        self.fd = os.open(path, os.O_RDWR)  # read-write: never sees EOF between writers
        self.records: list[Record] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, name="bench-fifo", daemon=True).start()

    def _read(self) -> None:
        pending = b""
        with contextlib.suppress(OSError):
            while chunk := os.read(self.fd, 1 << 16):
                pending += chunk
                whole = len(pending) - len(pending) % RECORD.size
                new = [
                    Record(*RECORD.unpack_from(pending, i)) for i in range(0, whole, RECORD.size)
                ]
                pending = pending[whole:]
                with self.cond:
                    self.records.extend(new)
                    self.cond.notify_all()

    def mark(self) -> int:
        with self.cond:
            return len(self.records)

    def wait(
        self, since: int, done: Callable[[list[Record]], bool], timeout: float
    ) -> list[Record]:
        """Records after ``since`` once ``done(records)`` holds (or fail after ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done(self.records[since:]):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"worker records: timed out ({len(self.records) - since})")
                self.cond.wait(left)
            return list(self.records[since:])

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class Batch:
    """One contender's batch: publish time and the records of its tasks."""

    contender: str
    n: int
    publish: float
    records: list[Record]
    cpu: dict[str, float]  # CPU seconds for the whole batch, by where it was spent

    @property
    def cpu_per_task(self) -> float:
        """Worker, PostgreSQL and publishing CPU per task (not the shared Redis server's)."""
        return sum(v for k, v in self.cpu.items() if k != "redis") / self.n

    @property
    def service(self) -> list[float]:
        return [r.t1 - r.t0 for r in self.records]

    @property
    def drain(self) -> float:
        return max(r.t1 for r in self.records) - min(r.t0 for r in self.records)


class BenchWorker:
    """``celery worker -P prefork -c N`` of ``benchmarks.worker_app``, fed batch by batch."""

    def __init__(
        self,
        env: dict[str, str],
        logs: Path,
        concurrency: int = 2,
        observer_dsn: str | None = None,
    ) -> None:
        self.node = f"bench-{common.RUN_ID}-{uuid.uuid4().hex[:4]}@{socket.gethostname()}"
        self.collector = Collector(logs / f"fifo-{uuid.uuid4().hex[:6]}")
        argv = common.celery(
            "-A",
            "benchmarks.worker_app",
            "worker",
            "-P",
            "prefork",
            "-c",
            str(concurrency),
            "-n",
            self.node,
            "-Q",
            f"{env['BENCH_PREFIX']}-idle",
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "-l",
            "WARNING",
        )
        full_env = {**env, "BENCH_FIFO": str(self.collector.path)}
        self.proc = common.start_process(argv, logs / "worker.log", full_env)
        self.prefix = env["BENCH_PREFIX"]
        self.observer = psycopg.connect(observer_dsn or env["PGLOCK_DSN"], autocommit=True)
        self.redis_pid = cpu.redis_pid(env["BENCH_BROKER_URL"])
        self._wait_ready()

    def _wait_ready(self) -> None:
        def ping() -> Any:
            if self.proc.poll() is not None:
                raise RuntimeError("the benchmark worker exited; see its log")
            return app.control.ping(destination=[self.node], timeout=0.5)

        common.wait_for(ping, 60, "the worker to answer a ping", poll=0.2)

    @property
    def pool_pids(self) -> list[int]:
        return common.children(self.proc.pid)

    def publish(self, contender: str, names: Sequence[str], queue: str) -> tuple[float, float]:
        """Publish one message per name; (wall seconds, CPU seconds of this thread)."""
        task = app.tasks[f"bench.{contender}"]
        slot_header = contender in ("session_slot", "transaction_slot")
        start, start_cpu = time.perf_counter(), time.thread_time()
        for n in names:
            headers = {"pglock_slot": n} if slot_header else {}
            task.apply_async((n,), queue=queue, headers=headers)
        return time.perf_counter() - start, time.thread_time() - start_cpu

    def cpu_ns(self) -> dict[str, int]:
        """CPU used so far by the worker, its PostgreSQL sessions and the Redis server."""
        workers = {self.proc.pid, *self.pool_pids}
        return {
            "worker": cpu.total_ns(workers),
            "postgres": cpu.total_ns(cpu.backends(self.observer, workers)),
            "redis": cpu.process_ns(self.redis_pid) if self.redis_pid else 0,
        }

    def run(
        self,
        contender: str,
        n: int,
        done: Callable[[list[Record]], bool] | None = None,
        timeout: float = 300.0,
    ) -> Batch:
        """Publish ``n`` messages of ``contender``, then let the worker drain them."""
        queue = f"{self.prefix}-q-{uuid.uuid4().hex[:8]}"
        names = [f"{queue}-{i}" for i in range(n)]
        before = self.cpu_ns()
        publish, publish_cpu = self.publish(contender, names, queue)
        code = CODES[f"bench.{contender}"]
        mark = self.collector.mark()

        def finished(records: list[Record]) -> bool:
            return sum(1 for r in records if r.kind == 1 and r.contender == code) >= n

        self.control("add_consumer", queue)
        try:
            records = self.collector.wait(mark, done or finished, timeout)
        finally:
            self.control("cancel_consumer", queue)
        after = self.cpu_ns()
        used = {key: (after[key] - before[key]) / 1e9 for key in before}
        mine = [r for r in records if r.contender == code and r.kind == 1]
        return Batch(contender, n, publish, mine, {**used, "publish": publish_cpu})

    def control(self, command: str, queue: str) -> None:
        replies = getattr(app.control, command)(
            queue, destination=[self.node], reply=True, timeout=5
        )
        if not replies:
            raise RuntimeError(f"{command} {queue}: the worker did not answer")

    def stop(self) -> None:
        common.stop_process(self.proc)
        self.observer.close()
        self.collector.close()


@contextlib.contextmanager
def bench_worker(
    env: dict[str, str], concurrency: int = 2, observer_dsn: str | None = None
) -> Iterator[BenchWorker]:
    with tempfile.TemporaryDirectory(prefix="pglockbench-") as logs:
        worker = BenchWorker(env, Path(logs), concurrency, observer_dsn)
        try:
            yield worker
        finally:
            worker.stop()
            log = Path(logs) / "worker.log"
            errors = [line for line in log.read_text().splitlines() if "ERROR" in line]
            if errors:
                print(f"  worker log had {len(errors)} ERROR lines, first: {errors[0][:300]}")
