"""The dashboard on real history: the overview with 1,000 beat entries and an entry's page
over a ledger of 10,000,000 rows (``--quick``: 100 entries, 100,000 rows).

One private schema, pre-filled with ``INSERT ... SELECT generate_series``: ``entries`` beat
entries (``job0000``…, each its own lock name through ``pglock_key``), one slot every 10
minutes each, newest now, one run in 50 failed; then ``VACUUM ANALYZE``. Each request is
what a browser's costs the server, timed end to end through the WSGI application
(werkzeug's test client, no network): a new labelled session, the statements, the HTML
(or JSON) rendered. Requests alternate between the pages; median and 95th percentile.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg
from celery import Celery
from psycopg import sql
from werkzeug.test import Client

from benchmarks import common
from celery_pglock import PgLockTask
from celery_pglock.schema import Tables
from celery_pglock.steering._history import PER_PAGE
from celery_pglock.web import make_app

TITLE = "13. Dashboard: 1,000 entries, 10,000,000 ledger rows"
CHUNK = 1_000_000
TARGET = 0.5  # seconds: "well under half a second"
FILL_SQL = """
INSERT INTO {runs} (lock_name, slot, lock_key, state, attempts, token, task_id, task_name,
                    host, pid, backend_pid, entry, created_at, scheduled_at, started_at,
                    finished_at, updated_at)
SELECT 'bench:job' || lpad((i %% {entries})::text, 4, '0'),
       to_char(t, 'YYYY-MM-DD"T"HH24:MI:SS"Z"'),
       i %% {entries}, CASE WHEN i %% 50 = 0 THEN 'failed' ELSE 'succeeded' END, 1, i,
       md5(i::text)::uuid::text, 'bench.job', 'worker-host-1', 4242, 4242,
       'job' || lpad((i %% {entries})::text, 4, '0'),
       t, t, t + interval '1 second', t + interval '1 second' + (i %% 7) * interval '1 second', t
FROM generate_series(%(start)s::bigint, %(stop)s::bigint) AS i,
     LATERAL (SELECT %(now)s::timestamptz - (i / {entries}) * interval '10 minutes' AS t) AS x
"""


@dataclass
class Result:
    entries: int
    rows: int
    fill_seconds: float
    times: dict[str, list[float]] = field(default_factory=dict)
    load: common.LoadWindow = field(default_factory=common.LoadWindow)


def make_bench_app(dsn: str, schema: str, entries: int) -> Celery:
    app = Celery("bench", set_as_current=False)
    app.conf.update(
        pglock_dsn=dsn,
        pglock_schema=schema,
        pglock_namespace="bench",
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
        beat_schedule={
            f"job{n:04d}": {"task": "bench.job", "schedule": 600.0, "args": (f"job{n:04d}",)}
            for n in range(entries)
        },
    )

    @app.task(base=PgLockTask, name="bench.job", pglock_key=lambda name: f"bench:{name}")
    def job(name: str) -> None:
        """The entries' task (never run: the ledger is pre-filled)."""

    return app


def fill(dsn: str, schema: str, entries: int, rows: int) -> float:
    started = time.perf_counter()
    runs = Tables(schema).table("runs")
    query = sql.SQL(FILL_SQL).format(runs=runs, entries=sql.Literal(entries))
    with psycopg.connect(dsn, autocommit=True) as conn:
        [(now,)] = conn.execute("SELECT date_trunc('minute', now()) - interval '1 minute'")
        for first in range(0, rows, CHUNK):
            last = min(rows, first + CHUNK) - 1
            conn.execute(query, {"start": first, "stop": last, "now": now})
            print(f"    {schema}: {last + 1:,} / {rows:,} rows", flush=True)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(runs))
    return time.perf_counter() - started


def run(dsn: str, *, entries: int, rows: int, requests: int) -> Result:
    with common.private_schema(dsn, "dashbench") as schema:
        seconds = fill(dsn, schema, entries, rows)
        client = Client(make_app(make_bench_app(dsn, schema, entries)))
        middle = f"job{entries // 2:04d}"
        pages = {
            "overview (HTML)": "/",
            "entry, 24 h (HTML)": f"/entry/{middle}",
            "entry, 7 days (HTML)": f"/entry/{middle}?hours=168",
            "overview, last page (HTML)": f"/?page={(entries - 1) // PER_PAGE}",
            "overview (JSON)": "/api/overview",
            "entry, 24 h (JSON)": f"/api/entry/{middle}",
        }
        result = Result(entries, rows, seconds, {name: [] for name in pages})
        for path in pages.values():  # warm: imports, templates, the schedule
            assert client.get(path).status_code == 200, path
        for _ in range(requests):
            for name, path in pages.items():
                started = time.perf_counter()
                response = client.get(path)
                result.times[name].append(time.perf_counter() - started)
                assert response.status_code == 200, (path, response.status_code)
        result.load.close()
    return result


def figures(result: Result) -> dict[str, tuple[float, float]]:
    """Per page: median and 95th percentile, in seconds."""
    return {
        name: (statistics.median(values), common.quantile(values, 0.95))
        for name, values in result.times.items()
    }


def lines(result: Result) -> list[str]:
    rows = [
        [name, str(len(result.times[name])), common.ms(median), common.ms(p95)]
        for name, (median, p95) in figures(result).items()
    ]
    return [
        f"{result.entries:,} entries, {result.rows:,} ledger rows (filled in "
        f"{result.fill_seconds:,.0f} s); each request end to end through the WSGI application "
        f"(a new session, the statements, the page); {result.load.text()}.",
        "",
        *common.table(["page", "requests", "median", "p95"], rows),
    ]


def section(result: Result) -> tuple[list[str], list[Any]]:
    """The report's section and its targets (each page's p95 under half a second)."""
    from benchmarks.report import Target  # noqa: PLC0415 - imports every contender

    targets = [
        Target(f"13. dashboard {name} (p95)", "< 500 ms", common.ms(p95), p95 < TARGET)
        for name, (_, p95) in figures(result).items()
    ]
    return lines(result), targets


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dashboard", description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    entries, rows, requests = (100, 100_000, 10) if args.quick else (1000, 10_000_000, 30)
    with common.postgres() as dsn:
        found = run(dsn, entries=entries, rows=rows, requests=requests)
    print("\n".join(lines(found)))


if __name__ == "__main__":
    main()
