"""The run policies: ``python -m benchmarks.policies``.

Two measures, on one PostgreSQL (``PGLOCK_DSN``, else a private embedded server):

- *claim cost*: one slotted run's ``acquire`` and ``release`` (session scope, the
  library's own calls in this process, one pooled connection per claim as in a worker),
  with ``pglock_concurrency = 1``, ``= 3`` (the first key free) and ``= 3`` with two of
  the three keys held by other sessions (the claim tries all three). Interleaved: every
  round runs a batch of each, in an order rotated per round; medians of per-claim times
  and their ratio to ``concurrency = 1``, in the same run.
- *finish → buffered start*: a real ``celery worker`` (prefork, concurrency 2, Redis) of
  ``tests.apps.testapp`` runs ``gated_buffered`` (``pglock_overlap = "buffer_one"``) for
  slot A, held at a gate; slot B arrives and waits (result ``WAITING``); the gate opens.
  Measured from A's ``finished`` to B's ``started`` (both ``clock_timestamp()`` in the
  task's execution rows): the holder's release, its look for the waiting slot, the
  publish, the broker, the worker's pick-up and B's claim.

Redis: ``BENCH_BROKER_URL`` (default ``redis://127.0.0.1:6379/8``), which must be empty at
the start and is emptied at the end. The section is written into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from importlib import metadata
from pathlib import Path

import psycopg
import redis

from benchmarks import common
from celery_pglock import WAITING
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key, lock_keys
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store._database import Database, close_all
from tests.apps import testapp
from tests.apps.harness import Gate, configure_client, executions, redis_app_env, start_workers
from tests.fixtures.procs import Procs

TITLE = "10. Run policies: `pglock_concurrency` and `pglock_overlap`"
DEFAULT_BROKER = "redis://127.0.0.1:6379/8"
DOCS = common.ROOT / "docs" / "benchmarks.md"
CONTENDERS = ("concurrency 1", "concurrency 3", "concurrency 3, 2 keys held")
DEADLINE = 30.0


def claim_cost(dsn: str, rounds: int, per_batch: int) -> dict[str, list[float]]:
    """Seconds per acquire + release, per contender, one value per claim."""
    with common.private_schema(dsn, "policies") as schema:
        db = Database(Settings(dsn=dsn, schema=schema))
        db.open()
        busy = f"bench:busy:{uuid.uuid4().hex[:6]}"
        holders = [psycopg.connect(dsn, autocommit=True) for _ in range(2)]
        for conn, key in zip(holders, lock_keys(busy, 3)[:2], strict=True):
            conn.execute("SELECT pg_try_advisory_lock(%s)", (key,))
        try:
            return _timed_rounds(db, busy, rounds, per_batch)
        finally:
            for conn in holders:
                conn.close()
            db.close()


def _timed_rounds(db: Database, busy: str, rounds: int, per_batch: int) -> dict[str, list[float]]:
    names = {CONTENDERS[0]: None, CONTENDERS[1]: None, CONTENDERS[2]: busy}
    concurrency = dict(zip(CONTENDERS, (1, 3, 3), strict=True))
    found: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for number in range(rounds + 1):  # round 0 warms the pool and the plans up
        for contender in common.rotate_list(CONTENDERS, number):
            for n in range(per_batch):
                name = names[contender] or f"bench:policies:{contender[-1]}:{n % 50}"
                keys = lock_keys(name, concurrency[contender])
                claim = Claim(
                    name,
                    lock_key(name),
                    f"{number}-{n}-{uuid.uuid4().hex[:8]}",
                    f"t-{number}-{n}",
                    "bench.policies",
                    keys=keys if len(keys) > 1 else (),
                )
                started = time.perf_counter()
                lease = acquire(db, claim, "session", 30.0)
                assert isinstance(lease, Lease), lease
                release(db, lease, SUCCEEDED)
                if number:
                    found[contender].append(time.perf_counter() - started)
    return found


def buffered_starts(dsn: str, broker: str, trials: int, log_dir: Path) -> list[float]:
    """Seconds from a holder's finish to its waiting slot's start, one per trial."""
    with common.private_schema(dsn, "buffered") as schema:
        env = redis_app_env(pg_dsn=dsn, schema=schema, redis_url=broker)
        configure_client(env)
        procs = Procs(log_dir, cwd=common.ROOT)
        try:
            start_workers(procs, env, 1, concurrency=2)
            return [_one_handover(dsn, schema, n) for n in range(trials)]
        finally:
            procs.stop_all()
            close_all()


def _one_handover(dsn: str, schema: str, n: int) -> float:
    task = testapp.gated_buffered
    before = len(executions(dsn, schema))
    with Gate(dsn) as gate:
        task.apply_async((gate.id,), headers={"pglock_slot": f"trial-{n}-a"})
        common.wait_for(
            lambda: len(executions(dsn, schema)) > before or None, DEADLINE, "slot A running"
        )
        waiting = task.apply_async((gate.id,), headers={"pglock_slot": f"trial-{n}-b"})
        common.wait_for(lambda: waiting.state == WAITING or None, DEADLINE, "slot B waiting")
    waiting.get(timeout=DEADLINE)
    first, second = executions(dsn, schema)[-2:]
    return float((second["started"] - first["finished"]).total_seconds())


def stats_row(label: str, values: Sequence[float], unit: Callable[[float], str]) -> list[str]:
    return [
        label,
        str(len(values)),
        unit(statistics.median(values)),
        unit(common.quantile(values, 0.95)),
    ]


def section(costs: dict[str, list[float]], handovers: list[float], facts: str) -> list[str]:
    base = statistics.median(costs[CONTENDERS[0]])
    rows = [
        [
            *stats_row(name, costs[name], common.us),
            common.ratio(statistics.median(costs[name]) / base),
        ]
        for name in CONTENDERS
    ]
    return [
        "Claim cost: one slotted run's `acquire` + `release` (session scope, the library's",
        "calls, one pooled connection), interleaved rounds, one run:",
        "",
        *common.table(["pglock_concurrency", "claims", "median", "p95", "vs 1"], rows),
        "",
        "What N > 1 adds: a PL/pgSQL call that tries the keys in turn, and the slot's own",
        "advisory key. Quote the ratio: on a shared machine the absolute times move between",
        "runs more than the ratio does.",
        "",
        'A waiting slot\'s start (`pglock_overlap = "buffer_one"`, a real prefork worker, Redis):',
        "from the holder's finish to the buffered slot's start, by the server's clock:",
        "",
        *common.table(
            ["measure", "trials", "median", "p95"],
            [stats_row("holder finished → waiting slot started", handovers, common.ms)],
        ),
        "",
        f"Machine: {facts}. Run: `python -m benchmarks.policies`.",
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


def write(lines: list[str]) -> None:
    """Replace (or add) this section of the docs."""
    DOCS.write_text(common.replace_section(DOCS.read_text(), TITLE, lines).rstrip("\n") + "\n")


def measure(dsn: str, broker: str, rounds: int, per_batch: int, trials: int) -> list[str]:
    """Both measures, on ``dsn`` and the (empty) Redis database ``broker``: the lines."""
    log_dir = Path(tempfile.mkdtemp(prefix="policies-"))
    load = common.LoadWindow()
    try:
        costs = claim_cost(dsn, rounds, per_batch)
        handovers = buffered_starts(dsn, broker, trials, log_dir)
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    load.close()
    return section(costs, handovers, machine(dsn, broker, load))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.policies", description=__doc__)
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds of claims")
    parser.add_argument("--per-batch", type=int, default=200, help="claims per batch")
    parser.add_argument("--trials", type=int, default=30, help="buffered handovers")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/")
    args = parser.parse_args(argv)
    broker = common.empty_broker(DEFAULT_BROKER)
    try:
        with common.postgres() as dsn:
            lines = measure(dsn, broker, args.rounds, args.per_batch, args.trials)
    finally:
        common.clean_redis(broker, ["*"])  # the database was empty at the start
    print("\n".join([f"## {TITLE}", "", *lines]))
    if not args.no_write:
        write(lines)
        print(f"written to {DOCS.relative_to(common.ROOT)}")


if __name__ == "__main__":
    main()
