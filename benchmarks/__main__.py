"""``python -m benchmarks`` (``make bench``): every benchmark, one report, one summary line.

Writes ``docs/benchmarks.md`` and PNG plots under ``docs/benchmarks/``. PostgreSQL:
``PGLOCK_DSN`` (a private schema per benchmark, dropped afterwards), else a private
embedded server. Redis: ``BENCH_REDIS_URL`` (default ``redis://127.0.0.1:6379``), in a
database that is empty when the run starts, emptied again at the end. ``--quick`` runs
everything small (a few minutes) to check the harness, not to quote.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from typing import Any

import psycopg
import redis

from benchmarks import common

SECTIONS = (
    "overhead",
    "failover",
    "tick",
    "ledger",
    "contention",
    "resources",
    "enqueue",
    "pools",
    "pgfailover",
    "policies",
    "adhoc",
    "budget",
    "dashboard",
    "handover",
    "backends",
)
DOCS = common.ROOT / "docs"
PLOTS = DOCS / "benchmarks"
PACKAGES = (
    "celery",
    "kombu",
    "psycopg",
    "redis",
    "celery-once",
    "celery-singleton",
    "celery-redbeat",
    "matplotlib",
    "gevent",
    "eventlet",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small runs, to check the harness")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/")
    parser.add_argument(
        "--quiet-wait", type=float, default=None, help="max seconds to wait for load < 1.5"
    )
    args = parser.parse_args(argv)
    args.only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    if args.quiet_wait is None:
        args.quiet_wait = 20.0 if args.quick else 180.0
    return args


PARAMS: dict[bool, dict[str, Any]] = {
    False: {
        "rounds": 10,
        "per_batch": 250,
        "trials": 12,
        "lease": 5.0,
        "default_trials": 3,
        "observe": 20.0,
        "tick_rounds": 3,
        "sizes": [0, 1_000_000, 10_000_000],
        "claims": 2000,
        "prune_size": 1_000_000,
        "contention_trials": 10,
        "tasks": 10_000,
    },
    True: {
        "rounds": 3,
        "per_batch": 100,
        "trials": 3,
        "lease": 2.0,
        "default_trials": 1,
        "observe": 5.0,
        "tick_rounds": 1,
        "sizes": [0, 100_000],
        "claims": 300,
        "prune_size": 100_000,
        "contention_trials": 3,
        "tasks": 2000,
    },
}


def versions(dsn: str, broker: str) -> str:
    found = []
    for name in PACKAGES:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found.append(f"{name} {metadata.version(name)}")
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SHOW server_version").fetchone()
    client = redis.Redis.from_url(broker)
    server = client.info("server").get("redis_version", "?")
    client.close()
    return (
        f"CPython {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"PostgreSQL {row[0] if row else '?'}, Redis {server}; " + ", ".join(found)
    )


class Run:
    """Runs the chosen sections, collecting report lines, targets and plots."""

    def __init__(self, args: argparse.Namespace, dsn: str, env: dict[str, str]) -> None:
        self.args = args
        self.params = PARAMS[args.quick]
        self.dsn = dsn
        self.env = env
        self.lines: list[str] = []
        self.targets: list[Any] = []
        self.plots: list[str] = []  # of the section running, placed after its text

    def section(self, title: str, body: Callable[[], tuple[list[str], list[Any]]]) -> None:
        load = common.wait_for_quiet(self.args.quiet_wait)
        print(f"== {title} (1-min load {load:.2f})", flush=True)
        started = time.monotonic()
        lines, targets = body()
        print(f"   done in {time.monotonic() - started:.0f} s", flush=True)
        self.lines += [f"## {title}", "", *lines, "", *self.plots]
        self.plots = []
        self.targets += targets

    def plot(self, draw: Callable[..., Any], data: Any, name: str) -> str:
        if self.args.no_write:
            return name
        PLOTS.mkdir(parents=True, exist_ok=True)
        draw(data, PLOTS / name)
        self.plots += [f"![{name}](benchmarks/{name})", ""]
        return name


def run_sections(run: Run) -> None:
    from benchmarks import (  # noqa: PLC0415 - after the environment is set
        contention,
        failover,
        ledger_scale,
        overhead,
        plots,
        report,
        report_beat,
        report_scale,
        resources,
        tick,
    )

    p = run.params
    only = run.args.only
    with common.private_schema(run.dsn, "worker") as schema:
        env = {**run.env, "BENCH_SCHEMA": schema}
        if "overhead" in only:

            def body1() -> tuple[list[str], list[Any]]:
                result = overhead.run(env, run.dsn, rounds=p["rounds"], per_batch=p["per_batch"])
                out = report.overhead_section(result)
                run.plot(plots.overhead_plot, result, "overhead.png")
                return out

            run.section("1. Per-task overhead (celery worker, prefork, concurrency 2)", body1)
        if "contention" in only:

            def body5() -> tuple[list[str], list[Any]]:
                backend = env["BENCH_BROKER_URL"]
                result = contention.run(
                    env, run.dsn, trials=p["contention_trials"], backend=backend
                )
                out = report_scale.contention_section(result)
                run.plot(plots.contention_plot, result, "contention.png")
                return out

            run.section("5. Contention: 64 deliveries of one slot, 4 processes", body5)
        if "resources" in only:

            def body6() -> tuple[list[str], list[Any]]:
                result = resources.run(env, run.dsn, tasks=p["tasks"])
                out = report_scale.resources_section(result)
                run.plot(plots.resources_plot, result, "resources.png")
                return out

            run.section("6. Connections and memory", body6)
    if "failover" in only:

        def body2() -> tuple[list[str], list[Any]]:
            series, load = failover.run(
                run.env,
                run.dsn,
                trials=p["trials"],
                lease=p["lease"],
                default_trials=p["default_trials"],
                observe=p["observe"],
            )
            out = report_beat.failover_section(series, load.text())
            run.plot(plots.failover_plot, series, "failover.png")
            return out

        run.section("2. Beat failover: celery-pglock and celery-redbeat", body2)
    if "tick" in only:

        def body3() -> tuple[list[str], list[Any]]:
            result = tick.run(run.dsn, run.env["BENCH_BROKER_URL"], rounds=p["tick_rounds"])
            return report_beat.tick_section(result)

        run.section("3. Beat tick with 1,000 and 10,000 due entries", body3)
    if "ledger" in only:

        def body4() -> tuple[list[str], list[Any]]:
            result = ledger_scale.run(
                run.dsn, sizes=p["sizes"], claims=p["claims"], prune_size=p["prune_size"]
            )
            out = report_scale.ledger_section(result)
            run.plot(plots.ledger_plot, result, "ledger.png")
            return out

        run.section("4. Ledger scale", body4)
    later_sections(run)


def later_sections(run: Run) -> None:
    """Sections 7 to 14: each starts what it needs (servers, workers) itself."""
    only = run.args.only
    if "enqueue" in only:
        run.section("7. Enqueue-time check (`pglock_check_on_enqueue`)", lambda: enqueue(run))
    if "pools" in only:
        run.section(
            "8. Worker pools: 100 locked 1-second tasks at concurrency 100", lambda: pools(run)
        )
    if "pgfailover" in only:
        run.section(
            "9. PostgreSQL failover: a promoted streaming replica", lambda: pg_failover_section(run)
        )
    newest_sections(run)


def newest_sections(run: Run) -> None:
    """Sections 10 to 14, each in a module of its own."""
    if "policies" in run.args.only:
        run.section(policies_title(), lambda: policies_section(run))
    if "adhoc" in run.args.only:
        run.section(adhoc_title(), lambda: adhoc_section(run))
    if "budget" in run.args.only:
        run.section(
            "12. The connection budget (`max_connections = 100`)", lambda: budget_section(run)
        )
    if "dashboard" in run.args.only:
        run.section(dashboard_title(), lambda: dashboard_section(run))
    if "handover" in run.args.only:
        run.section(HANDOVER_TITLE, lambda: handover_section(run))
    if "backends" in run.args.only:
        run.section(backends_title(), lambda: backends_section(run))


def backends_title() -> str:
    from benchmarks import backends  # noqa: PLC0415

    return backends.TITLE


def backends_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.backends``: advisory locks and rows, side by side."""
    from benchmarks import backends  # noqa: PLC0415

    sizes = {"rounds": 2, "count": 50, "trials": 2} if run.args.quick else {}
    broker = run.env["BENCH_BROKER_URL"]
    return backends.section(backends.run(run.dsn, broker, seed=16, **sizes))


HANDOVER_TITLE = "14. Lock handover: a waiter after its holder lets go or dies"


def handover_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.handover``: a waiter's grant after a release and after a SIGKILL."""
    from benchmarks import handover  # noqa: PLC0415

    return handover.section(handover.run(run.dsn, trials=5 if run.args.quick else 20))


def enqueue(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.enqueue_check``: what the publish-time look-up costs a caller."""
    from benchmarks import enqueue_check  # noqa: PLC0415
    from celery_pglock.store._database import close_all  # noqa: PLC0415

    load = common.LoadWindow()
    rounds, size = (3, 50) if run.args.quick else (10, 200)
    with common.private_schema(run.dsn, "enqbench") as schema:
        redis_url = run.env["BENCH_BROKER_URL"]
        enqueue_check.run_done_slot(run.dsn, schema)
        app = enqueue_check.make_app(run.dsn, schema, redis_url)
        times = enqueue_check.measure(app, rounds, size)
        close_all()
        trips = enqueue_check.round_trips(run.dsn, schema, redis_url)
        app.close()
    load.close()
    lines = [
        f"{rounds} rounds {common.TIMES} {size} enqueues per contender, nothing consuming; "
        f"{load.text()}.",
        "",
        *enqueue_check.report(times, trips),
    ]
    return lines, []


def pools(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.pools``: every pool at concurrency 100, on a server of its own."""
    from benchmarks import pools as pool_bench  # noqa: PLC0415

    tasks = 20 if run.args.quick else pool_bench.TASKS
    contenders = pool_bench.CONTENDERS
    if run.args.quick:
        contenders = tuple(
            pool_bench.Contender(c.pool, 20, c.pool_size) for c in pool_bench.CONTENDERS
        )
    return pool_bench.section(pool_bench.run(run.env, tasks=tasks, contenders=contenders))


def pg_failover_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.pg_failover``: a promoted streaming replica, on servers of its own."""
    from benchmarks import pg_failover  # noqa: PLC0415

    trials = 2 if run.args.quick else 10
    return pg_failover.bench_section(run.env["BENCH_BROKER_URL"], trials)


def policies_title() -> str:
    from benchmarks import policies  # noqa: PLC0415

    return policies.TITLE


def policies_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.policies``: what pglock_concurrency costs a claim, how fast a waiting
    slot starts after its holder."""
    from benchmarks import policies  # noqa: PLC0415

    rounds, per_batch, trials = (2, 50, 5) if run.args.quick else (20, 200, 30)
    lines = policies.measure(run.dsn, run.env["BENCH_BROKER_URL"], rounds, per_batch, trials)
    return lines, []


def adhoc_title() -> str:
    from benchmarks import adhoc  # noqa: PLC0415

    return adhoc.TITLE


def adhoc_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.adhoc``: README's retrofit lines against stock Celery, ad-hoc messages."""
    from benchmarks import adhoc  # noqa: PLC0415

    rounds, per_batch = (2, 200) if run.args.quick else (5, 1000)
    lines, targets = adhoc.measure(run.dsn, run.env["BENCH_BROKER_URL"], rounds, per_batch)
    return lines, targets


def budget_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.budget``: 100 and 1,000 locked tasks at once per pool, on a server of
    100 connections, against plain Celery."""
    from benchmarks import budget  # noqa: PLC0415

    cases = (budget.Case("threads", 20), budget.Case("gevent", 20)) if run.args.quick else None
    return budget.section(budget.run(run.env, cases or budget.CASES))


def summary(targets: list[Any], written: bool) -> str:
    """One line: how many targets were met, and each missed one with its result."""
    measured = [t for t in targets if t.met is not None]
    met = sum(1 for t in measured if t.met)
    missed = [f"{t.measure.split(' ', 1)[1]}: {t.result}" for t in measured if not t.met]
    tail = f"; missed: {'; '.join(missed)}" if missed else ""
    where = " (docs/benchmarks.md)" if written else ""
    return f"bench: {met}/{len(measured)} targets met{tail}{where}"


def document(run: Run, header: str, load: common.LoadWindow, started: str) -> str:
    from benchmarks import report  # noqa: PLC0415

    mode = "`--quick` (harness check, not for quoting)" if run.args.quick else "full"
    return "\n".join(
        [
            "# Benchmarks",
            "",
            f"`make bench` ({mode}), started {started}; {header}.",
            f"Whole run: {load.text()} (2 shared cores: absolute times move between runs,",
            "ratios measured within one run move much less).",
            "",
            "## Every figure against its target",
            "",
            *report.targets_table(run.targets),
            "",
            *run.lines,
        ]
    )


def dashboard_title() -> str:
    from benchmarks import dashboard  # noqa: PLC0415

    return dashboard.TITLE


def dashboard_section(run: Run) -> tuple[list[str], list[Any]]:
    """``benchmarks.dashboard``: the overview of 1,000 entries, an entry over 10 M rows."""
    from benchmarks import dashboard  # noqa: PLC0415

    entries, rows, requests = (100, 100_000, 10) if run.args.quick else (1000, 10_000_000, 30)
    result = dashboard.run(run.dsn, entries=entries, rows=rows, requests=requests)
    return dashboard.section(result)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    started = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    load = common.LoadWindow()
    base = common.redis_base()
    database = common.pick_redis_db(base)
    broker = f"{base}/{database}"
    env = {"BENCH_BROKER_URL": broker, "BENCH_PREFIX": common.KEY_PREFIX}
    with common.postgres() as dsn:
        env["PGLOCK_DSN"] = dsn
        os.environ.update(env)  # benchmarks.worker_app reads it when imported
        header = versions(dsn, broker)
        print(f"benchmarks: {header}; Redis database {database}", flush=True)
        run = Run(args, dsn, env)
        try:
            run_sections(run)
        finally:
            removed = common.clean_redis(broker, ["*"])  # the database was empty at the start
            print(f"removed {removed} Redis keys from database {database}", flush=True)
    load.close()
    text = document(run, header, load, started)
    if args.no_write:
        print(text)
    else:
        (DOCS / "benchmarks.md").write_text(text)
        print(f"written to docs/benchmarks.md and {PLOTS.relative_to(common.ROOT)}/")
    print(summary(run.targets, written=not args.no_write))


if __name__ == "__main__":
    main()
