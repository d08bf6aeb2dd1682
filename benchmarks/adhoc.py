"""Ad-hoc messages under README's retrofit: ``python -m benchmarks.adhoc``.

Three real ``celery worker -P prefork -c 2`` (Redis broker) run one no-op task, configured
as ``benchmarks.adhoc_app`` says: stock Celery (``plain``), README's retrofit lines
(``readme``: ``pglock_all_tasks = True``), and those plus ``pglock_slot = "message"``
(``message``: redeliveries deduplicated by task id). Rounds of one batch per worker, in an
order rotated per round: each batch is published into a fresh queue while its worker does
not consume it, then drained (``add_consumer``). *Drain*: first ``task_prerun`` to last
``task_postrun`` over the batch, per task. *Rate vs plain*: plain's drain time over the
contender's, within each round (1.00x: as fast as stock Celery).

PostgreSQL: ``PGLOCK_DSN``, else a private embedded server. Redis: ``BENCH_BROKER_URL``
(default ``redis://127.0.0.1:6379/7``), empty at the start, emptied at the end. The section
is written into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import socket
import statistics
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psycopg
import redis
from psycopg import sql

from benchmarks import common
from benchmarks.records import PRERUN_POSTRUN
from benchmarks.report import Target
from benchmarks.workers import Collector

TITLE = "11. Only duplicates skipped: ad-hoc messages under `pglock_all_tasks`"
DEFAULT_BROKER = "redis://127.0.0.1:6379/7"
DOCS = common.ROOT / "docs" / "benchmarks.md"
MODES = ("plain", "readme", "message")
LABELS = {
    "plain": "stock Celery",
    "readme": "README's retrofit lines (`pglock_all_tasks = True`)",
    "message": 'the same + `pglock_slot = "message"` (redeliveries deduplicated)',
}
TARGET = 0.9  # README's lines drain ad-hoc messages at least this fast, relative to plain
TIMEOUT = 300.0


@dataclass
class Worker:
    """One ``celery worker`` of ``benchmarks.adhoc_app`` in one mode."""

    mode: str
    node: str
    proc: Any
    collector: Collector


@contextlib.contextmanager
def workers(env: dict[str, str], logs: Path) -> Iterator[dict[str, Worker]]:
    started: dict[str, Worker] = {}
    try:
        for mode in MODES:
            started[mode] = _start(mode, env, logs)
        for worker in started.values():
            _wait_ready(worker)
        yield started
    finally:
        for worker in started.values():
            common.stop_process(worker.proc)
            worker.collector.close()


def _start(mode: str, env: dict[str, str], logs: Path) -> Worker:
    node = f"adhoc-{mode}-{common.RUN_ID}@{socket.gethostname()}"
    collector = Collector(logs / f"fifo-{mode}")
    argv = common.celery(
        *("-A", "benchmarks.adhoc_app", "worker", "-P", "prefork", "-c", "2", "-n", node),
        *("-Q", f"{env['BENCH_PREFIX']}-{mode}-idle", "--without-gossip", "--without-mingle"),
        *("--without-heartbeat", "-l", "WARNING"),
    )
    full_env = {**env, "BENCH_MODE": mode, "BENCH_FIFO": str(collector.path)}
    proc = common.start_process(argv, logs / f"worker-{mode}.log", full_env)
    return Worker(mode, node, proc, collector)


def _wait_ready(worker: Worker) -> None:
    from benchmarks.adhoc_app import app  # noqa: PLC0415 - after BENCH_BROKER_URL is set

    def ping() -> Any:
        if worker.proc.poll() is not None:
            raise RuntimeError(f"the {worker.mode} worker exited; see its log")
        return app.control.ping(destination=[worker.node], timeout=0.5)

    common.wait_for(ping, 60, f"the {worker.mode} worker to answer a ping", poll=0.2)


def drain(worker: Worker, n: int) -> tuple[float, float]:
    """Publish ``n`` messages for ``worker``, let it drain them: (drain, median service) per
    task, in seconds."""
    from benchmarks.adhoc_app import TASK, app  # noqa: PLC0415

    queue = f"{common.KEY_PREFIX}-{worker.mode}-{uuid.uuid4().hex[:8]}"
    task = app.tasks[TASK]
    for i in range(n):
        task.apply_async((f"{queue}-{i}",), queue=queue)
    mark = worker.collector.mark()
    _control(app, "add_consumer", queue, worker)
    try:
        found = worker.collector.wait(
            mark, lambda records: sum(r.kind == PRERUN_POSTRUN for r in records) >= n, TIMEOUT
        )
    finally:
        _control(app, "cancel_consumer", queue, worker)
    runs = [r for r in found if r.kind == PRERUN_POSTRUN]
    span = max(r.t1 for r in runs) - min(r.t0 for r in runs)
    return span / n, statistics.median(r.t1 - r.t0 for r in runs)


def _control(app: Any, command: str, queue: str, worker: Worker) -> None:
    replies = getattr(app.control, command)(queue, destination=[worker.node], reply=True)
    if not replies:
        raise RuntimeError(f"{command} {queue}: the {worker.mode} worker did not answer")


def rounds(running: dict[str, Worker], count: int, per_batch: int) -> list[dict[str, Any]]:
    """Interleaved rounds (after a warm-up batch each); per round and mode, drain and service."""
    for worker in running.values():
        drain(worker, min(per_batch, 100))
    found = []
    for number in range(count):
        current = {}
        for mode in common.rotate_list(MODES, number):
            current[mode] = drain(running[mode], per_batch)
        found.append(current)
        rates = [current["plain"][0] / current[m][0] for m in MODES[1:]]
        print(f"  round {number + 1}/{count}: rate vs plain {[common.ratio(r) for r in rates]}")
    return found


def ledger_rows(dsn: str, schema: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "pglock_runs"))
        row = conn.execute(query).fetchone()
    return int(row[0]) if row else 0


def section(found: list[dict[str, Any]], per_batch: int, rows: int, facts: str) -> list[str]:
    table = []
    for mode in MODES:
        drains = [r[mode][0] for r in found]
        services = [r[mode][1] for r in found]
        rates = [r["plain"][0] / r[mode][0] for r in found]
        low, high = common.ratio(min(rates)), common.ratio(max(rates))
        table.append(
            [
                LABELS[mode],
                common.us(statistics.median(drains)),
                common.us(statistics.median(services)),
                f"{common.ratio(statistics.median(rates))} ({low}{common.DASH}{high})",
            ]
        )
    readme = statistics.median(r["plain"][0] / r["readme"][0] for r in found)
    verdict = "met" if readme >= TARGET else "**missed**"
    total = len(found) * per_batch
    return [
        f"{len(found)} rounds {common.TIMES} {per_batch:,} no-op ad-hoc messages (`delay()`, no",
        f"slot) per configuration, {total:,} each; one `celery worker -P prefork -c 2` per",
        "configuration, Redis broker, batches interleaved in an order rotated every round.",
        "",
        *common.table(
            ["configuration", "drain per task", "service (median)", "rate vs plain"], table
        ),
        "",
        f"README's lines against stock Celery: {common.ratio(readme)} the drain rate (target",
        f"at least {TARGET:.1f}{common.TIMES}: {verdict}). A slot-less ad-hoc message of a",
        "task locked app-wide takes no lock and no round trip: what is left is the",
        '`__call__` wrapper reading the message\'s headers. With `pglock_slot = "message"`',
        "each message claims its task id in the ledger and records its outcome (two waited",
        "round trips, as any slotted run): the price of skipping a redelivery of a message",
        f"that already succeeded, durably and across workers. Ledger rows written: {rows:,}",
        "(one per message of that configuration, warm-up included).",
        "",
        f"Machine: {facts}. Run: `python -m benchmarks.adhoc`.",
    ]


def machine(dsn: str, broker: str, load: common.LoadWindow) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    version = redis.Redis.from_url(broker).info().get("redis_version", "?")
    found = [f"{n} {metadata.version(n)}" for n in ("celery", "kombu", "psycopg")]
    return (
        f"CPython {platform.python_version()}, {os.cpu_count()} CPUs, PostgreSQL "
        f"{row[0] if row else '?'}, Redis {version}; {', '.join(found)}; {load.text()}"
    )


def target(found: list[dict[str, Any]]) -> Target:
    rates = [r["plain"][0] / r["readme"][0] for r in found]
    result = f"{common.ratio(statistics.median(rates))} ({common.ratio(min(rates))}"
    return Target(
        "11. README's retrofit lines: drain rate of ad-hoc messages vs stock Celery",
        f"≥ {TARGET:.1f}{common.TIMES}",
        f"{result}{common.DASH}{common.ratio(max(rates))})",
        statistics.median(rates) >= TARGET,
    )


def measure(dsn: str, broker: str, count: int, per_batch: int) -> tuple[list[str], list[Target]]:
    """The section's lines and target, measured on ``dsn`` and the (empty) Redis database
    ``broker``."""
    os.environ["BENCH_BROKER_URL"] = broker  # read by benchmarks.adhoc_app on import
    load = common.LoadWindow()
    with (
        common.private_schema(dsn, "adhoc") as schema,
        tempfile.TemporaryDirectory(prefix="pglock-adhoc-") as logs,
    ):
        env = {
            "PGLOCK_DSN": dsn,
            "BENCH_SCHEMA": schema,
            "BENCH_PREFIX": schema,
            "BENCH_BROKER_URL": broker,
        }
        with workers(env, Path(logs)) as running:
            found = rounds(running, count, per_batch)
        rows = ledger_rows(dsn, schema)
    load.close()
    return section(found, per_batch, rows, machine(dsn, broker, load)), [target(found)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.adhoc", description=__doc__)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--per-batch", type=int, default=1000, help="messages per batch")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/")
    args = parser.parse_args(argv)
    broker = common.empty_broker(DEFAULT_BROKER)
    try:
        with common.postgres() as dsn:
            lines, _ = measure(dsn, broker, args.rounds, args.per_batch)
    finally:
        common.clean_redis(broker, ["*"])  # the database was empty at the start
    print("\n".join([f"## {TITLE}", "", *lines]))
    if not args.no_write:
        DOCS.write_text(common.replace_section(DOCS.read_text(), TITLE, lines).rstrip("\n") + "\n")
        print(f"written to {DOCS.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
