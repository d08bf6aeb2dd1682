"""Schedule entries stored in PostgreSQL at scale: a beat tick with nothing due, with 10 and
with 100,000 stored entries, side by side; the first tick that reads them all; a tick
after one change; memory per entry.

One ``PgLockScheduler`` in this process (active-active: no election to wait for; nothing
falls due during the measure: every entry is daily, due at midnight UTC, so the broker
is never used) on a real PostgreSQL (``PGLOCK_DSN``, a private schema dropped
afterwards). The entries are seeded by one ``INSERT … SELECT`` (as 100,000 calls of
``schedules.add`` would store them, without their audit rows).

And a burst, side by side: 10,000 entries due on the same 10-s boundary, stored among
100,000 in PostgreSQL, against the same 10,000 in ``beat_schedule`` (benchmarks/tick.py);
one ``PgLockScheduler`` leading (election on), a real Redis broker whose queue is counted
afterwards: the tick's start to the last confirmation (every message on the broker), to
the first, and the CPU per message sent; and the stored ones again sent by two forked
senders (``pglock_beat_senders = 2``). Beside it, in the same run, what bounds it:
Celery's publish alone (``send_task`` of as many messages into kombu's batches, with
kombu's producer and with beat's), and two processes each sending half of the burst at
the same second. Run::

    python -m benchmarks.stored_entries [--entries 100000] [--ticks 200] [--due 10000]

Writes its section into ``docs/benchmarks.md`` (and its rows of the targets table).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg
import redis
from celery import Celery
from psycopg import sql

from benchmarks import common
from benchmarks import tick as tick_bench
from benchmarks.common import Target
from celery_pglock import schedules
from celery_pglock.beat import PgLockScheduler
from celery_pglock.beat._freshness import SLICE
from celery_pglock.beat._producer import declaring_once
from celery_pglock.beat._sending import CONFIRM_BATCH
from celery_pglock.schema import Tables
from celery_pglock.store._database import close_all

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
TITLE = "15. Schedules in PostgreSQL at scale"
ROW = "| 15. "  # this section's rows of the targets table start so
BURST_TARGET = 2.0  # seconds: 10,000 due at once all on the broker (issue 34)
BURST_EVERY = 10  # seconds: the due entries' interval (all due on one boundary)
SENDERS = 2  # pglock_beat_senders of the burst measured beside the one-process ones
SHARED = f"stored, {SENDERS} senders"  # that burst's rows
SEED = (
    """INSERT INTO {entries} (namespace, name, task, schedule, version, changed_by)
       SELECT %(namespace)s, 'e' || n, 'bench.report', jsonb_build_object('every', 86400),
              1, 'bench'
         FROM generate_series(1, %(count)s) AS n""",
    "INSERT INTO {versions} (namespace, version) VALUES (%(namespace)s, 1)",
)
# The burst's entries: the first ``due`` of them fall due together, every BURST_EVERY s.
DUE = """UPDATE {entries} SET schedule = jsonb_build_object('every', %(every)s)
          WHERE namespace = %(namespace)s AND substr(name, 2)::int <= %(due)s"""


@dataclass
class Run:
    entries: int
    first_tick: float  # seconds: reads every entry, builds them, looks at each once
    tick_median: float  # seconds: a tick with nothing due
    tick_p95: float
    tick_cpu: float  # CPU seconds per tick with nothing due
    changed_tick: float  # seconds: the tick after one entry changed
    bytes_per_entry: float
    overdue_tick: float  # seconds: a tick with nothing due, pglock_overdue_after set app-wide


@dataclass
class Burst:
    where: str  # "stored" or "code"
    span: float  # seconds: tick start to the last confirmation
    first_confirmed: float
    cpu_per_send: float
    on_broker: int


@dataclass
class Bounds:
    """What bounds a burst, measured beside it."""

    publish_stock: list[float]  # CPU s per message: Celery's send_task alone, kombu's producer
    publish_beat: list[float]  # the same through beat's producer
    halves: list[list[float]]  # spans of two processes sending half each at the same second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--ticks", type=int, default=200)
    parser.add_argument("--due", type=int, default=10_000, help="entries due at once")
    parser.add_argument("--rounds", type=int, default=3, help="bursts of each kind")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/")
    parser.add_argument("--half-of", type=int, help=argparse.SUPPRESS)  # a half's process
    args = parser.parse_args()
    dsn = os.environ.get("PGLOCK_DSN", "postgresql://postgres@127.0.0.1:5432/test")
    if args.half_of:
        send_half(dsn, args.half_of)
        return
    broker = common.empty_broker("redis://127.0.0.1:6379/15")
    runs = [measure(dsn, count, args.ticks) for count in (10, SLICE, args.entries)]
    bursts = []
    bounds = Bounds([], [], [])
    for _ in range(args.rounds):  # alternately: the machine's load moves
        bursts.append(measure_burst(dsn, broker, args.entries, args.due))
        bursts.append(measure_code_burst(dsn, broker, args.due))
        bursts.append(measure_burst(dsn, broker, args.entries, args.due, senders=SENDERS))
        bounds.publish_stock.append(publish_cpu(broker, args.due, beat_producer=False))
        bounds.publish_beat.append(publish_cpu(broker, args.due, beat_producer=True))
        bounds.halves.append(measure_halves(broker, args.due))
        print("\n".join(f"  {burst}" for burst in bursts[-3:]), f"\n  {bounds}", flush=True)
    lines = report(runs, args.ticks, bursts, args.due, bounds)
    print("\n".join(lines))
    if not args.no_write:
        write(lines, target_rows(bursts, args.due, args.entries, bounds))


def measure(dsn: str, count: int, ticks: int) -> Run:
    schema = f"bench_stored_{uuid.uuid4().hex[:8]}"
    app = stored_app(dsn, schema)
    try:
        schedules.entries(app)  # creates the tables
        seed(dsn, schema, count)
        beat = PgLockScheduler(app=app)
        started = time.perf_counter()
        beat.tick()
        first = time.perf_counter() - started
        cpu = time.process_time()
        times = tick_times(beat, ticks)
        cpu = (time.process_time() - cpu) / ticks
        schedules.update(app, "e1", every="12h", force=True)
        changed = tick_times(beat, 1)[0]
        beat.close()
        held = memory_of_a_load(app, count)
        watched = stored_app(dsn, schema, pglock_overdue_after=3600.0)
        try:
            beat = PgLockScheduler(app=watched)
            beat.tick()  # reads them all
            overdue = statistics.median(tick_times(beat, ticks))
            beat.close()
        finally:
            watched.close()
        return Run(
            count,
            first,
            statistics.median(times),
            times[int(len(times) * 0.95)],
            cpu,
            changed,
            held / count,
            overdue,
        )
    finally:
        app.close()
        close_all()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def stored_app(dsn: str, schema: str, **conf: Any) -> Celery:
    """An app whose entries are stored in ``schema``: active-active, no broker, unless
    ``conf`` says otherwise."""
    app = Celery("bench-stored", set_as_current=False)
    defaults = {"pglock_beat_leader": False, "broker_url": "memory://", "beat_schedule": {}}
    app.conf.update(
        {"pglock_dsn": dsn, "pglock_schema": schema, "pglock_namespace": schema} | defaults | conf
    )
    return app


def tick_times(beat: PgLockScheduler, ticks: int) -> list[float]:
    """``ticks`` ticks back to back, each doing what a tick a second after the last one
    does (``pglock_beat_max_interval = 1``): it looks at the stored entries' changes and
    at the ledger's freshness. Sorted."""
    times = []
    for _ in range(ticks):
        beat._next_entry_check = 0.0
        beat._freshness._next = 0.0
        started = time.perf_counter()
        beat.tick()
        times.append(time.perf_counter() - started)
    return sorted(times)


def measure_burst(dsn: str, broker: str, count: int, due: int, senders: int = 1) -> Burst:
    """The tick that sends ``due`` stored entries (of ``count``) falling due together, by
    ``senders`` processes (``pglock_beat_senders``)."""
    schema = f"bench_burst_{uuid.uuid4().hex[:8]}"
    queue = f"{common.KEY_PREFIX}-burst-{uuid.uuid4().hex[:8]}"
    app = stored_app(
        dsn,
        schema,
        pglock_beat_leader=True,
        pglock_beat_senders=senders,
        broker_url=broker,
        task_default_queue=queue,
    )
    where = "stored" if senders == 1 else SHARED
    try:
        schedules.entries(app)  # creates the tables
        seed(dsn, schema, count, due=due)
        tick = tick_bench.measure(app, due)
        return Burst(
            where, tick.span, tick.first_confirmed, tick.cpu_per_send, on_broker(broker, queue)
        )
    finally:
        app.close()
        close_all()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def measure_code_burst(dsn: str, broker: str, due: int) -> Burst:
    """The same burst from ``beat_schedule`` (benchmarks/tick.py's app)."""
    queue = f"{common.KEY_PREFIX}-burst-{uuid.uuid4().hex[:8]}"
    with common.private_schema(dsn, "burst") as schema:
        app = tick_bench.tick_app(dsn, broker, schema, queue, due)
        try:
            tick = tick_bench.measure(app, due)
        finally:
            app.close()
            close_all()
    return Burst(
        "code", tick.span, tick.first_confirmed, tick.cpu_per_send, on_broker(broker, queue)
    )


def publish_cpu(broker: str, count: int, *, beat_producer: bool) -> float:
    """CPU seconds per message of Celery's publish alone: ``count`` ``send_task`` calls
    into kombu's batches of CONFIRM_BATCH (as beat sends them), by kombu's producer or by
    beat's (``declaring_once``); no database, no schedule."""
    queue = f"{common.KEY_PREFIX}-publish-{uuid.uuid4().hex[:8]}"
    app = Celery("bench-publish", set_as_current=False)
    app.conf.update(broker_url=broker, task_default_queue=queue)
    producer_class = declaring_once(app.amqp.Producer) if beat_producer else app.amqp.Producer
    try:
        with app.connection_for_write() as connection:
            producer: Any = producer_class(connection, auto_declare=False)
            with producer.batch(max_size=4 * CONFIRM_BATCH) as batch:
                cpu = time.process_time()
                for n in range(count):
                    app.send_task("bench.noop", producer=producer, headers={"n": n})
                    if n % CONFIRM_BATCH == CONFIRM_BATCH - 1:
                        batch.flush()
                batch.flush()
                cpu = time.process_time() - cpu
        assert on_broker(broker, queue) == count
        return cpu / count
    finally:
        app.close()


def measure_halves(broker: str, due: int) -> list[float]:
    """Two processes, each a leading ``PgLockScheduler`` with half of ``due`` in its
    ``beat_schedule`` (benchmarks/tick.py), sending at the same second: their spans.
    Measured again if their ticks did not start within 0.5 s of each other."""
    for _ in range(3):
        env = {**os.environ, "BENCH_BROKER_URL": broker}
        command = [sys.executable, "-m", "benchmarks.stored_entries", "--half-of", str(due)]
        halves = [subprocess.Popen(command, env=env, stdout=subprocess.PIPE) for _ in range(2)]
        answers = [json.loads(half.communicate(timeout=120)[0]) for half in halves]
        starts = [answer["start"] for answer in answers]
        if max(starts) - min(starts) < 0.5:
            return [answer["span"] for answer in answers]
    raise RuntimeError("the two halves never sent at the same second")


def send_half(dsn: str, due: int) -> None:
    """A half's process (``--half-of``): prints its span and when its tick started."""
    broker = os.environ["BENCH_BROKER_URL"]
    queue = f"{common.KEY_PREFIX}-half-{uuid.uuid4().hex[:8]}"
    with common.private_schema(dsn, "half") as schema:
        app = tick_bench.tick_app(dsn, broker, schema, queue, due // 2)
        try:
            tick = tick_bench.measure(app, due // 2)
            start = time.time() - tick.span
        finally:
            app.close()
            close_all()
    assert on_broker(broker, queue) == due // 2
    print(json.dumps({"span": tick.span, "start": start}))


def on_broker(broker: str, queue: str) -> int:
    """Messages on ``queue`` (then dropped, with kombu's records of its declaration)."""
    client = redis.Redis.from_url(broker)
    try:
        return int(client.llen(queue))
    finally:
        client.delete(queue, f"_kombu.binding.{queue}", f"_kombu.binding_permanent.{queue}")
        client.close()


def memory_of_a_load(app: Celery, count: int) -> float:
    """Bytes a beat replica holds for ``count`` stored entries: a second replica's first
    tick, under tracemalloc (apart from the timings: it slows Python several times)."""
    beat = PgLockScheduler(app=app)
    tracemalloc.start()
    baseline, _ = tracemalloc.get_traced_memory()
    beat.tick()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    beat.close()
    return float(held - baseline)


def seed(dsn: str, schema: str, count: int, *, due: int = 0) -> None:
    tables = Tables(schema)
    names = {"entries": tables.table("entries"), "versions": tables.table("entry_versions")}
    params = {"namespace": schema, "count": count, "due": due, "every": BURST_EVERY}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for text in (*SEED, DUE):
            conn.execute(sql.SQL(text).format(**names), params)


def report(runs: list[Run], ticks: int, bursts: list[Burst], due: int, bounds: Bounds) -> list[str]:
    tiny, small, large = runs  # 10, a look's slice, and the many
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return [
        f"Measured by `python -m benchmarks.stored_entries` (CPython {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average at the end {load}, {now}; PostgreSQL and Redis on "
        "the same host).",
        "",
        "**A tick, by how many entries are stored.** One `PgLockScheduler` (active-active), "
        f"daily entries stored in PostgreSQL, nothing due during the {ticks} ticks measured; "
        "each of them does what a tick a second after the last one does "
        "(`pglock_beat_max_interval = 1`): it looks at the stored entries' changes (one "
        "number read) and at the ledger's freshness (`pglock_overdue_after`: the entries in "
        f"play, and {SLICE:,} more in turn). The ratio is {large.entries:,} entries' against "
        f"{small.entries:,}'s.",
        "",
        f"| | {tiny.entries:,} entries | {small.entries:,} entries | {large.entries:,} entries "
        "| ratio |",
        "|---|---|---|---|---|",
        _row("a tick, nothing due (median)", [r.tick_median for r in runs]),
        _row("a tick, nothing due (p95)", [r.tick_p95 for r in runs]),
        _row("CPU per tick, nothing due", [r.tick_cpu for r in runs]),
        _row(
            "a tick, nothing due, `pglock_overdue_after` set (median)",
            [r.overdue_tick for r in runs],
        ),
        _row("the tick after one entry changed", [r.changed_tick for r in runs]),
        _row("the first tick (reads, looks at every entry)", [r.first_tick for r in runs]),
        "| memory per stored entry (the first tick) | "
        + " | ".join(f"{r.bytes_per_entry:,.0f} B" for r in runs)
        + " | |",
        "",
        "A tick reads one number (the namespace's newest change) and only the entries "
        "changed since; the planner reads only the entries whose look has come (a heap on "
        "the next look: the next occurrence, at least every five minutes); the freshness "
        f"look reads the entries in play and {SLICE:,} more. So a tick with nothing due "
        "reads no stored entry and looks at a bounded number of them. What grows with the "
        "entries: each entry's look every five minutes (at "
        f"{large.entries:,} entries about {large.entries / 300:,.0f} a second: most of what "
        f"a tick costs more than at {small.entries:,}); the first tick of a replica that "
        "starts leading, which reads and builds every entry (about "
        f"{large.first_tick / large.entries * 1e6:.0f} µs each: its first sends come that "
        f"much later after a failover); and the freshness round (a second per {SLICE:,} "
        "entries).",
        "",
        f"**{due:,} entries due at the same second**, stored among {large.entries:,} in "
        f"PostgreSQL, and the same {due:,} in `beat_schedule`, and the stored ones again "
        f"with `pglock_beat_senders = {SENDERS}` (the leader claims, {SENDERS} processes "
        "forked from it publish), run in turn; one `PgLockScheduler` leading (election "
        "on), a real Redis broker (kombu's publish batches), every message counted on the "
        "queue afterwards. The CPU per send is the leader's and its senders'.",
        "",
        "| | span: all on the broker | first confirmed | CPU per send | on the broker |",
        "|---|---|---|---|---|",
        *(
            f"| {b.where} | {b.span:.2f} s | {b.first_confirmed:.2f} s "
            f"| {b.cpu_per_send * 1e6:.0f} µs | {b.on_broker:,} |"
            for b in bursts
        ),
        "",
        f"Median span: stored {_median(bursts, 'stored'):.2f} s, code "
        f"{_median(bursts, 'code'):.2f} s "
        f"({_median(bursts, 'stored') / _median(bursts, 'code'):.2f}×); "  # noqa: RUF001 - the report's sign
        f"stored with {SENDERS} senders {_median(bursts, SHARED):.2f} s "
        f"({_median(bursts, SHARED) / _median(bursts, 'stored'):.2f}× one process's).",  # noqa: RUF001 - the report's sign
        "",
        *bounds_lines(bursts, due, bounds),
    ]


def bounds_lines(bursts: list[Burst], due: int, bounds: Bounds) -> list[str]:
    """What bounds the burst, measured beside it in the same rounds."""
    stock = statistics.median(bounds.publish_stock)
    beat = statistics.median(bounds.publish_beat)
    per_send = statistics.median(b.cpu_per_send for b in bursts if b.where == "stored")
    halves = [statistics.median(spans) for spans in zip(*bounds.halves, strict=True)]
    return [
        "**What bounds it**, measured in the same rounds:",
        "",
        "| | CPU per message | for the burst |",
        "|---|---|---|",
        f"| Celery's publish alone, kombu's producer | {stock * 1e6:.0f} µs "
        f"| {stock * due:.2f} s |",
        f"| Celery's publish alone, beat's producer | {beat * 1e6:.0f} µs | {beat * due:.2f} s |",
        f"| the leader's whole send (stored, median) | {per_send * 1e6:.0f} µs "
        f"| {per_send * due:.2f} s |",
        "",
        f"Celery's publish alone is `send_task` of {due:,} messages into kombu's batches of "
        f"{CONFIRM_BATCH} (as beat sends them), with no database and no schedule. Beat's "
        "producer looks in kombu's cache of declared queues before kombu binds a copy of "
        "the queue to look there, once per message (celery_pglock/beat/_producer.py); the "
        "rest of the leader's send is the planner, Celery's `reserve` of the entry and our "
        "side of the claim and confirmation statements, whose round trips are in the span "
        f"as well. For {due:,} messages Celery's publish alone is {beat * due:.2f} s of one "
        f"core, {beat * due / BURST_TARGET:.0%} of the {BURST_TARGET:.0f} s target, before "
        "any of ours. Two processes, each a leading "
        f"`PgLockScheduler` with {due // 2:,} of the entries in `beat_schedule`, sending at "
        "the same second, had their halves on the broker in "
        f"{halves[0]:.2f} s and {halves[1]:.2f} s (medians): the most two senders can "
        "give on these two cores. One beat with `pglock_beat_senders = 2` comes within "
        f"{_median(bursts, SHARED) - max(halves):.2f} s of it (its claim, its confirmations "
        "and the forks are the leader's).",
    ]


def target_rows(bursts: list[Burst], due: int, count: int, bounds: Bounds) -> list[Target]:
    shared = _median(bursts, SHARED)
    spans = ", ".join(f"{b.span:.2f}" for b in bursts if b.where == SHARED)
    return [
        Target(
            f"15. {due:,} stored entries (of {count:,}) due at once: all on the broker",
            f"≤ {BURST_TARGET:.0f} s",
            f"{shared:.2f} s median with `pglock_beat_senders = {SENDERS}` ({spans} s); "
            f"one process: {_median(bursts, 'stored'):.2f} s",
            shared <= BURST_TARGET,
        )
    ]


def write(lines: list[str], targets: list[Target]) -> None:
    """Replace (or add) this section and its rows of the targets table in the docs."""
    common.write_section(DOCS, TITLE, lines, ROW, targets)


def _median(bursts: list[Burst], where: str) -> float:
    return statistics.median(b.span for b in bursts if b.where == where)


def _row(what: str, seconds: list[float]) -> str:
    """Milliseconds at each size, and the last size's against the one before."""
    ratio = seconds[-1] / seconds[-2] if seconds[-2] else float("nan")
    cells = " | ".join(f"{value * 1000:.2f} ms" for value in seconds)
    return f"| {what} | {cells} | {ratio:.2f}× |"  # noqa: RUF001 - the report's sign


if __name__ == "__main__":
    main()
