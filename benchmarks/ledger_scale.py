"""Ledger scale: claim latency with 0, 1 M and 10 M ledger rows, and during a prune.

One private schema per size, pre-filled with ``INSERT ... SELECT generate_series`` (200
lock names, one slot a minute each, finished 30 days ago), then ``VACUUM ANALYZE``. A
*claim* is what a locked task with a slot costs in PostgreSQL through our code:
``acquire`` (session scope, lease armed) and ``release`` of a new slot on one of those 200
lock names, of two kinds: a caller's slot (no coalescing), and a beat-sent time slot with
its entry (``pglock_coalesce = "latest"``, the default for beat messages, which looks for
a newer succeeded slot). Claims run interleaved across schemas and kinds. Then, on the
1 M schema, ``retention.prune`` deletes every pre-filled row from another process while
the harness keeps claiming: claim latency during the prune against just before it.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

import psycopg
from psycopg import sql

from benchmarks import common
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.retention import prune
from celery_pglock.schema import Tables
from celery_pglock.store._database import Database, close_all, database

LOCK_NAMES = 200
CHUNK = 1_000_000
FILL_SQL = """
INSERT INTO {runs} (lock_name, slot, lock_key, state, attempts, token, task_id, task_name,
                    host, pid, backend_pid, created_at, started_at, finished_at, updated_at)
SELECT 'bench:job' || (i %% {names}),
       to_char(timestamptz '2020-01-01 00:00:00+00' + (i / {names}) * interval '1 minute',
               'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
       i %% {names}, 'succeeded', 1, i, md5(i::text)::uuid::text, 'bench.job',
       'worker-host-1', 4242, 4242, old, old, old, old
FROM generate_series(%(start)s::bigint, %(stop)s::bigint) AS i,
     LATERAL (SELECT now() - interval '30 days' AS old) AS t
"""


@dataclass
class Result:
    sizes: list[int]
    latencies: dict[tuple[int, str], list[float]]  # (ledger rows, claim kind)
    fill_seconds: dict[int, float]
    table_bytes: dict[int, int]
    before_prune: list[float] = field(default_factory=list)
    during_prune: list[float] = field(default_factory=list)
    prune_seconds: float = 0.0
    pruned_rows: int = 0
    load: common.LoadWindow = field(default_factory=common.LoadWindow)


def fill(dsn: str, schema: str, rows: int) -> float:
    """Pre-fill the ledger with ``rows`` finished runs; seconds taken."""
    start = time.perf_counter()
    runs = Tables(schema).table("runs")
    query = sql.SQL(FILL_SQL).format(runs=runs, names=sql.Literal(LOCK_NAMES))
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(1, rows + 1, CHUNK):
            last = min(rows, first + CHUNK - 1)
            conn.execute(query, {"start": first, "stop": last})
            print(f"    {schema}: {last:,} / {rows:,} rows", flush=True)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(runs))
    return time.perf_counter() - start


def table_bytes(dsn: str, schema: str) -> int:
    name = Tables(schema).table("runs").as_string()
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (name,)).fetchone()
    return int(row[0]) if row else 0


KINDS = ("caller slot", "beat slot, coalescing")
BEAT_EPOCH = datetime(2030, 1, 1, tzinfo=timezone.utc)  # after every pre-filled slot


class Claimer:
    """Claims new slots through our ``acquire``/``release``, one schema each."""

    def __init__(self, dsn: str, schema: str, kind: str = KINDS[0]) -> None:
        self.db: Database = database(Settings(dsn=dsn, schema=schema, pool_size=1))
        self.beat = kind != KINDS[0]
        self.count = 0

    def next_claim(self) -> Claim:
        self.count += 1
        name = f"bench:job{self.count % LOCK_NAMES}"
        key, task = lock_key(name), f"task-{self.count}"
        if self.beat:  # a time slot per second, its entry, coalescing on
            slot = f"{BEAT_EPOCH + timedelta(seconds=self.count):%Y-%m-%dT%H:%M:%SZ}"
            entry = f"entry{self.count % LOCK_NAMES}"
            return Claim(name, key, slot, task, "bench.job", pid=1, entry=entry, coalesce=True)
        slot = f"{datetime.now(timezone.utc):%Y-%m-%dT%H:%M:%S.%fZ}-{self.count}"
        return Claim(name, key, slot, task, "bench.job", pid=1)

    def claim(self) -> float:
        claim = self.next_claim()
        start = time.perf_counter()
        lease = acquire(self.db, claim, "session", 30.0)
        assert isinstance(lease, Lease), lease
        release(self.db, lease, SUCCEEDED)
        return time.perf_counter() - start


def _prune(dsn: str, schema: str, out: multiprocessing.Queue[tuple[float, int]]) -> None:
    start = time.perf_counter()
    with psycopg.connect(dsn, autocommit=True) as conn:
        result = prune(conn, Tables(schema), timedelta(days=7))
    out.put((time.perf_counter() - start, result.deleted["runs"]))


def claims_during_prune(dsn: str, schema: str, claimer: Claimer, result: Result) -> None:
    result.before_prune = [claimer.claim() for _ in range(300)]
    context = multiprocessing.get_context("spawn")
    out: multiprocessing.Queue[tuple[float, int]] = context.Queue()
    pruner = context.Process(target=_prune, args=(dsn, schema, out), daemon=True)
    pruner.start()
    time.sleep(0.5)  # the child imports, connects and starts deleting
    try:
        while pruner.is_alive():
            result.during_prune.append(claimer.claim())
        result.prune_seconds, result.pruned_rows = out.get(timeout=10)
    finally:
        pruner.join(5)
        if pruner.is_alive() and pruner.pid is not None:
            os.kill(pruner.pid, 9)


@contextlib.contextmanager
def schemas(dsn: str, sizes: list[int], result: Result) -> Iterator[dict[int, str]]:
    with contextlib.ExitStack() as stack:
        found = {}
        for size in sizes:
            found[size] = stack.enter_context(common.private_schema(dsn, f"ledger{size}"))
            result.fill_seconds[size] = fill(dsn, found[size], size) if size else 0.0
            result.table_bytes[size] = table_bytes(dsn, found[size])
        yield found


def run(dsn: str, *, sizes: list[int], claims: int, prune_size: int) -> Result:
    keys = [(size, kind) for size in sizes for kind in KINDS]
    result = Result(sizes, {key: [] for key in keys}, {}, {})
    try:
        with schemas(dsn, sizes, result) as made:
            result.load = common.LoadWindow()  # not counting the fill
            claimers = {(size, kind): Claimer(dsn, made[size], kind) for size, kind in keys}
            for claimer in claimers.values():
                for _ in range(50):  # warm-up: connection, prepared statements, cache
                    claimer.claim()
            for number in range(claims):
                for key in common.rotate_list(keys, number):
                    result.latencies[key].append(claimers[key].claim())
            if prune_size in made:
                pruning = claimers[(prune_size, KINDS[0])]
                claims_during_prune(dsn, made[prune_size], pruning, result)
            close_all()
    finally:
        close_all()
    result.load.close()
    return result
