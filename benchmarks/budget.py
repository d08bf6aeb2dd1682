"""The connection budget: 100 and 1,000 locked 1-second tasks at once, per pool, on a
server with the stock ``max_connections = 100``, against plain Celery.

For each pool a ``celery worker -P <pool>`` runs ``benchmarks.budget`` (this module is
also its app): N messages of ``budget.locked`` (locked on a key of its own, session
scope, no slot; the body sleeps 1 s, a green sleep under gevent) or of ``budget.plain``
(the same body, unlocked), published at once. Threads and gevent run at concurrency N;
prefork at concurrency 100 (1,000 processes do not fit this machine): its 1,000 tasks
queue through 100 children. Measured per run: wall time from the first publish to the
last result, the peak number of the library's sessions in ``pg_stat_activity`` (sampled
every 20 ms), the library's sessions 2 s after the last result and after the idle
timeout, retries (the worker log's ``will be retried`` lines), and the worker's CPU
time (its process tree, user + system) per task over the run.
"""

from __future__ import annotations

import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import psycopg

from benchmarks import common
from benchmarks.pools import RETRIED, Sampler, bench_app, own_key, private_server
from celery_pglock import PgLockTask

ENV = os.environ
SLEEP = 1.0
MAX_CONNECTIONS = 100
IDLE_TIMEOUT = 5.0  # pglock_idle_timeout for the run (default 30 s): the after-idle count

app = bench_app("budget", pglock_idle_timeout=IDLE_TIMEOUT)


@app.task(name="budget.locked", base=PgLockTask, pglock_key=own_key)
def locked(n: str) -> float:
    time.sleep(SLEEP)
    return SLEEP


@app.task(name="budget.plain")
def plain(n: str) -> float:
    time.sleep(SLEEP)
    return SLEEP


@dataclass(frozen=True)
class Case:
    pool: str
    tasks: int

    @property
    def concurrency(self) -> int:
        return min(self.tasks, 100) if self.pool == "prefork" else self.tasks


CASES = tuple(Case(pool, n) for n in (100, 1000) for pool in ("prefork", "threads", "gevent"))


@dataclass
class Outcome:
    case: Case
    locked: bool
    wall: float
    peak: int
    after: int  # library sessions 2 s after the last result
    after_idle: int  # ... and after the idle timeout
    retries: int
    failed: int
    cpu_per_task: float  # seconds
    announced: str
    busy_client_ok: bool | None  # a new client connected mid-burst
    client_ok: bool  # ... and 2 s after the last result


def client_connects(dsn: str) -> bool:
    """Whether another client (``celery pglock status``, the application) gets a session."""
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.OperationalError:
        return False
    return True


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return total


def measure(env: dict[str, str], dsn: str, case: Case, *, with_lock: bool) -> Outcome:
    queue = f"{env['BENCH_PREFIX']}-budget-{uuid.uuid4().hex[:8]}"
    node = f"budget-{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory(prefix="pglockbench-budget-") as tmp:
        log = Path(tmp) / "worker.log"
        argv = common.celery(
            *("-A", "benchmarks.budget", "worker", "-P", case.pool),
            *("-c", str(case.concurrency), "-n", f"{node}@%h", "-Q", queue),
            *("--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "INFO"),
        )
        proc = common.start_process(argv, log, env)
        try:
            ready = f"{node}@{socket.gethostname()} ready."

            def is_ready() -> bool:
                if proc.poll() is not None:
                    raise RuntimeError(f"the {case.pool} worker exited; see {log}")
                return ready in log.read_text(errors="replace")

            common.wait_for(is_ready, 300, f"the {case.pool} worker", poll=0.2)
            task = locked if with_lock else plain
            run = uuid.uuid4().hex[:8]
            with Sampler(dsn) as sampler:
                cpu_before = tree_cpu(proc.pid)
                started = time.perf_counter()
                results = [
                    task.apply_async((f"{queue}-{run}-{i}",), queue=queue)
                    for i in range(case.tasks)
                ]
                busy_client_ok = None
                failed = 0
                for number, result in enumerate(results):
                    if number == len(results) // 2:  # mid-burst: can another client connect?
                        busy_client_ok = client_connects(dsn)
                    try:
                        result.get(timeout=600, propagate=True)
                    except Exception:
                        failed += 1
                wall = time.perf_counter() - started
                cpu = tree_cpu(proc.pid) - cpu_before
                time.sleep(2.0)
                after = sampler.count()
                client_ok = client_connects(dsn)
                deadline = time.monotonic() + IDLE_TIMEOUT * 3
                after_idle = after
                while time.monotonic() < deadline:
                    time.sleep(0.5)
                    after_idle = sampler.count()
                    if after_idle == 0:
                        break
            text = log.read_text(errors="replace")
        finally:
            common.stop_process(proc, timeout=120)
    lines = text.splitlines()
    announced = next((line for line in lines if "opens at most" in line), "")
    return Outcome(
        case=case,
        locked=with_lock,
        wall=wall,
        peak=sampler.peak,
        after=after,
        after_idle=after_idle,
        retries=sum(1 for line in lines if RETRIED in line),
        failed=failed,
        cpu_per_task=cpu / case.tasks,
        announced=re.sub(r"^\[[^]]*\] ", "", announced),
        busy_client_ok=busy_client_ok,
        client_ok=client_ok,
    )


def run(env: dict[str, str], cases: Sequence[Case] = CASES) -> list[Outcome]:
    outcomes = []
    with private_server(MAX_CONNECTIONS) as dsn, common.private_schema(dsn, "budget") as schema:
        worker_env = {**env, "PGLOCK_DSN": dsn, "BENCH_SCHEMA": schema}
        broker = env["BENCH_BROKER_URL"]
        app.conf.update(broker_url=broker, result_backend=broker)
        for case in cases:
            for with_lock in (False, True):
                what = "locked" if with_lock else "plain"
                print(f"   {case.pool} -c {case.concurrency}, {case.tasks} {what}", flush=True)
                outcomes.append(measure(worker_env, dsn, case, with_lock=with_lock))
                print("  ", outcomes[-1], flush=True)
    return outcomes


def yes(value: bool | None) -> str:
    return "no" if value is False else "yes"


def section(outcomes: Sequence[Outcome]) -> tuple[list[str], list[Any]]:
    plain_of = {o.case: o for o in outcomes if not o.locked}
    rows = [
        "| pool | concurrency | tasks at once | wall (plain Celery) | ratio | peak library "
        "connections | 2 s after | after idle | another client connects (burst / after) | "
        "retries | failed | CPU per task (plain) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        if not o.locked:
            continue
        p = plain_of[o.case]
        rows.append(
            f"| `{o.case.pool}` | {o.case.concurrency} | {o.case.tasks} | {o.wall:.2f} s "
            f"({p.wall:.2f} s) | {o.wall / p.wall:.2f}{common.TIMES} | {o.peak} | {o.after} | "
            f"{o.after_idle} | {yes(o.busy_client_ok)} / {yes(o.client_ok)} | "
            f"{o.retries} | {o.failed} | {o.cpu_per_task * 1000:.1f} ms "
            f"({p.cpu_per_task * 1000:.1f} ms) |"
        )
    said = sorted(
        {
            f"- `{o.case.pool} -c {o.case.concurrency}`: {o.announced}"
            for o in outcomes
            if o.locked and o.announced
        }
    )
    return [*rows, "", "What each worker said at start-up:", "", *said], []


def main() -> None:
    base = common.redis_base()
    database = common.pick_redis_db(base)
    broker = f"{base}/{database}"
    env = {"BENCH_BROKER_URL": broker, "BENCH_PREFIX": common.KEY_PREFIX}
    os.environ.update(env)
    only = ENV.get("BENCH_BUDGET_CASES")  # e.g. "gevent:100,threads:1000"
    cases = CASES
    if only:
        pairs = [item.split(":") for item in only.split(",")]
        cases = tuple(Case(pool, int(tasks)) for pool, tasks in pairs)
    try:
        lines, _ = section(run(env, cases))
    finally:
        common.clean_redis(broker, ["*"])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
