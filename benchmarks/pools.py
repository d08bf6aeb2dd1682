"""Worker pools: 100 locked 1-second tasks at once, per pool, with default settings.

For each pool a ``celery worker -P <pool> -c 100`` runs ``benchmarks.pools`` (this module
is also its app): 100 messages of ``bench.pool_hold``, each locked on a key of its own,
whose body sleeps 1 s (a green sleep under gevent/eventlet). Two rounds: the first opens
the connections, the second finds them open. Measured: wall time from the first publish
to the last result in Redis, retries (the worker log's ``will be retried`` lines), and the
peak number of our sessions in ``pg_stat_activity`` (sampled every 20 ms): pooled ones
are named ``celery-pglock …``, a lock holder renames its session ``pglock <pid> …``.

On a private embedded PostgreSQL with ``max_connections = 500``: a threads worker of
concurrency 100 may open 101 connections, prefork's 100 children as many, and each new
process briefly two more, more than a stock server's 100 (or one shared with other work).
``solo`` runs one task at a time (100 s here, by design) and is left out.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery

from benchmarks import common
from celery_pglock import PgLockTask

ENV = os.environ
SLEEP = 1.0
TASKS = 100
CONCURRENCY = 100
MAX_CONNECTIONS = 500
SAMPLE_EVERY = 0.02
OURS_SQL = (
    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'celery-pglock%' "
    "OR application_name LIKE 'pglock %'"
)
RETRIED = "will be retried"


def bench_app(name: str, **conf: Any) -> Celery:
    """A benchmark worker's app (``celery -A benchmarks.<name> worker``), configured from
    the environment: broker, PostgreSQL, schema, ``BENCH_POOL_SIZE`` (unset: "auto"),
    ``BENCH_SHARED_SESSIONS=0`` (``pglock_shared_sessions = False``)."""
    app = Celery(f"pglockbench-{name}")
    app.conf.update(
        broker_url=ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15"),
        result_backend=ENV.get("BENCH_BROKER_URL", "redis://127.0.0.1:6379/15"),
        worker_prefetch_multiplier=1,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        pglock_dsn=ENV.get("PGLOCK_DSN", ""),
        pglock_schema=ENV.get("BENCH_SCHEMA", "public"),
        pglock_namespace=ENV.get("BENCH_PREFIX", "pglockbench") + f"-{name}",
        **conf,
    )
    if ENV.get("BENCH_POOL_SIZE"):
        app.conf.pglock_pool_size = int(ENV["BENCH_POOL_SIZE"])
    if ENV.get("BENCH_SHARED_SESSIONS") == "0":  # one connection per locked run, as before
        app.conf.pglock_shared_sessions = False
    return app


app = bench_app("pools")


def own_key(n: str, **_: Any) -> str:
    return n


@app.task(name="bench.pool_hold", base=PgLockTask, pglock_key=own_key)
def pool_hold(n: str) -> float:
    """Hold the lock on ``n`` for ``SLEEP`` seconds."""
    time.sleep(SLEEP)
    return SLEEP


# -- harness -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Contender:
    pool: str
    concurrency: int
    pool_size: int | None = None  # None: the default ("auto")

    @property
    def label(self) -> str:
        size = "auto" if self.pool_size is None else str(self.pool_size)
        return f"{self.pool} -c {self.concurrency}, pglock_pool_size {size}"


CONTENDERS = (
    Contender("prefork", CONCURRENCY),
    Contender("threads", CONCURRENCY),
    Contender("gevent", CONCURRENCY),
    Contender("eventlet", CONCURRENCY),
    Contender("threads", CONCURRENCY, pool_size=4),
)


@dataclass
class Outcome:
    contender: Contender
    walls: list[float]  # per round
    peaks: list[int]  # our sessions on the server, per round
    failed: int
    retries: int
    announced: str  # the worker's start-up line on connections
    warnings: list[str] = field(default_factory=list)
    start_seconds: float = 0.0


@dataclass
class Result:
    outcomes: list[Outcome]
    tasks: int
    load: common.LoadWindow


class Sampler:
    """The peak number of our sessions on the server while it runs."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.peak = 0
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-pools", daemon=True)

    def count(self) -> int:
        row = self.conn.execute(OURS_SQL).fetchone()
        return int(row[0]) if row else 0

    def _run(self) -> None:
        while not self.stopping.is_set():
            self.peak = max(self.peak, self.count())
            self.stopping.wait(SAMPLE_EVERY)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.thread.join()
        self.conn.close()


@contextmanager
def private_server(max_connections: int = MAX_CONNECTIONS) -> Iterator[str]:
    """A private embedded PostgreSQL allowing ``max_connections`` sessions."""
    from celery_pglock.testing.embedded import EmbeddedPostgres  # noqa: PLC0415

    with EmbeddedPostgres() as server:
        server.start()
        server.stop()
        server.set_config(max_connections=max_connections)
        server.start()
        yield server.dsn


@contextmanager
def worker(env: dict[str, str], logs: Path, contender: Contender) -> Iterator[tuple[str, Path]]:
    """A ready ``celery worker`` of ``contender`` on a queue of its own: (queue, log)."""
    queue = f"{env['BENCH_PREFIX']}-pools-{uuid.uuid4().hex[:8]}"
    node = f"pools-{uuid.uuid4().hex[:6]}"
    log = logs / f"{contender.pool}-{contender.pool_size or 'auto'}.log"
    argv = common.celery(
        *("-A", "benchmarks.pools", "worker", "-P", contender.pool),
        *("-c", str(contender.concurrency), "-n", f"{node}@%h", "-Q", queue),
        *("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"),
    )
    extra = {"BENCH_POOL_SIZE": str(contender.pool_size or "")}
    proc = common.start_process(argv, log, {**env, **extra})
    ready = f"{node}@{socket.gethostname()} ready."
    try:

        def is_ready() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"the {contender.pool} worker exited; see {log}")
            return ready in log.read_text(errors="replace")

        common.wait_for(is_ready, 180, f"the {contender.pool} worker", poll=0.2)
        yield queue, log
    finally:
        common.stop_process(proc, timeout=60)


def one_round(queue: str, tasks: int, sampler_dsn: str) -> tuple[float, int, int]:
    """Publish ``tasks`` messages, wait for every result: (wall seconds, peak, failed)."""
    run = uuid.uuid4().hex[:8]
    with Sampler(sampler_dsn) as sampler:
        started = time.perf_counter()
        results = [
            pool_hold.apply_async((f"{queue}-{run}-{i}",), queue=queue) for i in range(tasks)
        ]
        failed = 0
        for result in results:
            try:
                result.get(timeout=300, propagate=True)
            except Exception:
                failed += 1
        wall = time.perf_counter() - started
    return wall, sampler.peak, failed


def measure(env: dict[str, str], dsn: str, contender: Contender, tasks: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="pglockbench-pools-") as tmp:
        begun = time.monotonic()
        with worker(env, Path(tmp), contender) as (queue, log):
            start_seconds = time.monotonic() - begun
            walls, peaks, failed = [], [], 0
            for _ in range(2):
                wall, peak, lost = one_round(queue, tasks, dsn)
                walls.append(wall)
                peaks.append(peak)
                failed += lost
            text = log.read_text(errors="replace")
    lines = text.splitlines()
    announced = next((line for line in lines if "opens at most" in line), "")
    return Outcome(
        contender=contender,
        walls=walls,
        peaks=peaks,
        failed=failed,
        retries=sum(1 for line in lines if RETRIED in line),
        announced=re.sub(r"^\[[^]]*\] ", "", announced),
        warnings=[
            re.sub(r"^\[[^]]*\] ", "", line)
            for line in lines
            if "WARNING/MainProcess] pglock" in line or "WARNING/MainProcess] pool" in line
        ],
        start_seconds=start_seconds,
    )


def run(
    env: dict[str, str], *, tasks: int = TASKS, contenders: Sequence[Contender] = CONTENDERS
) -> Result:
    load = common.LoadWindow()
    outcomes = []
    with private_server() as dsn, common.private_schema(dsn, "pools") as schema:
        worker_env = {**env, "PGLOCK_DSN": dsn, "BENCH_SCHEMA": schema}
        broker = env["BENCH_BROKER_URL"]
        app.conf.update(broker_url=broker, result_backend=broker)
        for contender in contenders:
            print(f"   {contender.label}", flush=True)
            outcomes.append(measure(worker_env, dsn, contender, tasks))
    load.close()
    return Result(outcomes, tasks, load)


# -- report --------------------------------------------------------------------------------


def section(result: Result) -> tuple[list[str], list[Any]]:
    from benchmarks.report import Target  # noqa: PLC0415

    rows = []
    targets = []
    for o in result.outcomes:
        c = o.contender
        per_process = c.pool_size or (4 if c.pool == "prefork" else c.concurrency + 1)
        processes = c.concurrency if c.pool == "prefork" else 1
        rows.append(
            [
                f"`{c.pool}`",
                str(c.concurrency),
                "auto" if c.pool_size is None else str(c.pool_size),
                f"{o.walls[0]:.2f} s",
                f"{o.walls[1]:.2f} s",
                str(o.retries),
                str(o.failed),
                f"{max(o.peaks)}",
                f"{per_process} {common.TIMES} {processes}",
                f"{o.start_seconds:.0f} s",
            ]
        )
        if c.pool_size is None:
            targets.append(
                Target(
                    f"8. {result.tasks} {common.TIMES} 1 s locked tasks at once, "
                    f"{c.pool} -c {c.concurrency}: retries",
                    "0",
                    f"{o.retries} (wall {o.walls[1]:.2f} s warm, {o.walls[0]:.2f} s cold)",
                    o.retries == 0 and o.failed == 0,
                )
            )
            # One connection per task running at once: prefork children run one each,
            # a process running them as threads or greenlets one per task, plus a spare.
            expected = c.concurrency if c.pool == "prefork" else per_process
            targets.append(
                Target(
                    f"8. peak lock connections, {c.pool} -c {c.concurrency}",
                    f"\N{LESS-THAN OR EQUAL TO} {expected}",
                    str(max(o.peaks)),
                    max(o.peaks) <= expected,
                )
            )
    concurrency = max(o.contender.concurrency for o in result.outcomes)
    lines = [
        f"{result.tasks} messages of a task locked on a key of its own (session scope, no "
        f"slot) whose body sleeps {SLEEP:g} s, published at once to a `celery worker -c "
        f"{concurrency}`, two rounds (*cold*: the worker's first, its connections opened "
        "on demand; *warm*: the next). *wall*: first publish to last result (Redis result "
        "backend). *peak*: our sessions in `pg_stat_activity` (`application_name` "
        "`celery-pglock …` or, while holding, `pglock …`), sampled every 20 ms over both "
        f"rounds. Private embedded PostgreSQL (`max_connections = {MAX_CONNECTIONS}`); "
        f"{result.load.text()}.",
        "",
        *common.table(
            [
                "pool",
                "concurrency",
                "pglock_pool_size",
                "wall, cold",
                "wall, warm",
                "retries",
                "failed",
                "peak connections",
                f"cap (per process {common.TIMES} processes)",
                "worker start",
            ],
            rows,
        ),
        "",
        "What each worker said at start-up:",
        "",
        *[f"- `{o.contender.label}`: {o.announced or '(nothing)'}" for o in result.outcomes],
    ]
    warned = [(o, w) for o in result.outcomes for w in o.warnings]
    if warned:
        lines += ["", "Warnings at start-up:", ""]
        lines += [f"- `{o.contender.label}`: {w}" for o, w in warned]
    lines += [
        "",
        "An explicit `pglock_pool_size` below the concurrency makes tasks take turns: each "
        "freed connection goes to a waiting task at once, but a task that waits longer than "
        "`pglock_connect_timeout` (5 s) is retried, and each such timeout opens one probe "
        "connection (to tell a server refusing connections from a busy pool): the peak "
        "above the pool's size. `solo` is not in the table: it runs one task at a time "
        "(100 tasks of 1 s take 100 s) on one connection. Prefork at concurrency 100 on 2 "
        "cores is feasible but heavy: 100 processes to fork and stop (*worker start*), "
        "and its main process hands each message to a child over a pipe (*wall*).",
    ]
    return lines, targets
