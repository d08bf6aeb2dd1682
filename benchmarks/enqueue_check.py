"""What ``pglock_check_on_enqueue`` costs per ``apply_async``, against a real Redis broker.

``python -m benchmarks.enqueue_check [--rounds N] [--per-batch N]``. PostgreSQL:
``PGLOCK_DSN`` (a private schema, dropped afterwards). Redis: ``BENCH_REDIS_URL``, in a
database that is empty when the run starts and emptied again at the end. Nothing consumes
the queue: this times the caller only.

Contenders, interleaved per round in a rotated order so a slow phase of the shared machine
hits each alike:

- ``off``: the check off, a new slot (today's cost: publish only);
- ``on, new slot``: the check on, a slot never run (look-up, then publish);
- ``on, done slot``: the check on, a slot that succeeded (look-up, the skip logged in
  PostgreSQL, SKIPPED stored in the Redis result backend, nothing published);
- ``look-up alone``: the check's statement for a new slot, without Celery or a broker.

A separate, untimed pass counts PostgreSQL round trips per enqueue through a proxy.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from celery import Celery

from benchmarks import common
from benchmarks.roundtrips import CountingProxy
from celery_pglock import PgLockTask
from celery_pglock._config import Settings, app_settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED, enqueued_skip
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store._database import Database, close_all, database

DONE_SLOT = "2026-01-01T00:00:00Z"
LOCK = f"{common.KEY_PREFIX}:job"
CONTENDERS = ("off", "on, new slot", "on, done slot", "look-up alone")


def make_app(dsn: str, schema: str, redis_url: str) -> Celery:
    """An app with the same task twice: with and without the enqueue check."""
    app = Celery("enqbench", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        task_default_queue=f"{common.KEY_PREFIX}-queue",
        pglock_dsn=dsn,
        pglock_schema=schema,
    )
    for name, check in (("bench.off", False), ("bench.on", True)):
        app.task(
            base=PgLockTask,
            name=name,
            shared=False,
            pglock_key=LOCK,
            pglock_check_on_enqueue=check,
        )(job)
    return app


def job() -> None:
    """The body never runs here: nothing consumes the queue."""


def run_done_slot(dsn: str, schema: str) -> None:
    """Make DONE_SLOT a slot that already succeeded."""
    db = Database(Settings(dsn=dsn, schema=schema))
    db.open()
    try:
        lease = acquire(
            db, Claim(LOCK, lock_key(LOCK), DONE_SLOT, "done", "bench"), "session", None
        )
        assert isinstance(lease, Lease)
        release(db, lease, SUCCEEDED)
    finally:
        db.close()


def sender(app: Celery, contender: str) -> Callable[[int], Any]:
    """A function sending message ``n`` as ``contender`` does."""
    task = app.tasks["bench.off" if contender == "off" else "bench.on"]
    if contender == "look-up alone":
        db = database(app_settings(app))
        claim = Claim(LOCK, lock_key(LOCK), "never-run", "t", "bench.on")
        return lambda n: enqueued_skip(db, claim)
    if contender == "on, done slot":
        return lambda n: task.apply_async(headers={"pglock_slot": DONE_SLOT})
    prefix = f"{common.RUN_ID}-{contender[:2]}"
    return lambda n: task.apply_async(headers={"pglock_slot": f"{prefix}-{n}-{time.time_ns()}"})


def batch(send: Callable[[int], Any], size: int) -> float:
    """Seconds per enqueue over one batch."""
    started = time.perf_counter()
    for n in range(size):
        send(n)
    return (time.perf_counter() - started) / size


def measure(app: Celery, rounds: int, size: int) -> dict[str, list[float]]:
    senders = {name: sender(app, name) for name in CONTENDERS}
    for send in senders.values():
        batch(send, 20)  # warm-up: pools open, statements prepared
    found: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for number in range(rounds):
        for name in common.rotate_list(CONTENDERS, number):
            found[name].append(batch(senders[name], size))
    return found


def round_trips(dsn: str, schema: str, redis_url: str) -> dict[str, float]:
    """PostgreSQL round trips per enqueue, per contender, through a counting proxy."""
    info = Database(Settings(dsn=dsn, schema=schema)).pool.conninfo
    from psycopg.conninfo import conninfo_to_dict  # noqa: PLC0415 - only this pass needs it

    params = conninfo_to_dict(info)
    proxy = CountingProxy(str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    try:
        app = make_app(proxy.dsn(dsn), schema, redis_url)
        counts = {}
        for name in CONTENDERS:
            send = sender(app, name)
            batch(send, 10)
            proxy.reset()
            batch(send, 50)
            counts[name] = sum(proxy.snapshot().values()) / 50
        close_all()
        return counts
    finally:
        proxy.close()


@contextmanager
def redis_database() -> Iterator[str]:
    base = common.redis_base()
    url = f"{base}/{common.pick_redis_db(base)}"
    try:
        yield url
    finally:
        common.clean_redis(url, ["*"])  # the database was empty when we took it


def report(times: dict[str, list[float]], trips: dict[str, float]) -> list[str]:
    base = common.Summary.of(times["off"]).median
    rows = []
    for name in CONTENDERS:
        summary = common.Summary.of(times[name])
        extra = summary.median - base
        rows.append([name, summary.text(common.us), common.us(extra), f"{trips[name]:.2f}"])
    header = ["enqueue", "per apply_async, median (min-max)", "vs off", "PG round trips"]
    return common.table(header, rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.enqueue_check")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-batch", type=int, default=200)
    args = parser.parse_args(argv)
    dsn = os.environ.get("PGLOCK_DSN") or os.environ["PGLOCK_TEST_DSN"]
    load = common.LoadWindow()
    with common.private_schema(dsn, "enqbench") as schema, redis_database() as redis_url:
        run_done_slot(dsn, schema)
        app = make_app(dsn, schema, redis_url)
        times = measure(app, args.rounds, args.per_batch)
        close_all()
        trips = round_trips(dsn, schema, redis_url)
    load.close()
    print("\n".join(report(times, trips)))
    print(f"\n{args.rounds} rounds x {args.per_batch} enqueues each; {load.text()}")


if __name__ == "__main__":
    main()
