"""What every benchmark shares: servers, private names, machine load, statistics, processes.

Nothing here measures anything; it keeps each benchmark module about its measurement.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import psycopg
import redis
from psycopg import sql

from celery_pglock.schema import Tables
from celery_pglock.store._migrations import ensure_schema

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_REDIS = "redis://127.0.0.1:6379"
QUIET_LOAD = 1.5  # 1-min load average under which we prefer to start measuring
TIMES = "\N{MULTIPLICATION SIGN}"
DASH = "\N{EN DASH}"
RUN_ID = uuid.uuid4().hex[:8]
KEY_PREFIX = f"pglockbench-{RUN_ID}"  # every Redis key and queue of this run starts so


# -- machine load ------------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


def wait_for_quiet(max_wait: float, threshold: float = QUIET_LOAD) -> float:
    """Wait (at most ``max_wait`` s) for the 1-min load to drop under ``threshold``."""
    deadline = time.monotonic() + max_wait
    while (load := load_average()[0]) >= threshold and time.monotonic() < deadline:
        time.sleep(5)
    return load


@dataclass
class LoadWindow:
    """The load average when a section started and ended (the machine is shared)."""

    start: tuple[float, float, float] = field(default_factory=load_average)
    end: tuple[float, float, float] | None = None

    def close(self) -> None:
        self.end = load_average()

    def text(self) -> str:
        def fmt(load: tuple[float, float, float] | None) -> str:
            return " ".join(f"{x:.2f}" for x in load) if load else "?"

        return f"load average (1, 5, 15 min) at start {fmt(self.start)}, at end {fmt(self.end)}"


# -- statistics --------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1), linear between closest ranks."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """Median, minimum, maximum and count of a sample."""

    median: float
    low: float
    high: float
    runs: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Summary:
        if not values:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, unit: Callable[[float], str]) -> str:
        return f"{unit(self.median)} ({unit(self.low)}{DASH}{unit(self.high)})"


def us(seconds: float) -> str:
    return f"{seconds * 1e6:,.0f} µs" if not math.isnan(seconds) else DASH


def ms(seconds: float) -> str:
    if math.isnan(seconds):
        return DASH
    return f"{seconds * 1000:,.0f} ms" if abs(seconds) >= 0.0995 else f"{seconds * 1000:.1f} ms"


def ratio(value: float) -> str:
    return f"{value:.2f}{TIMES}" if not math.isnan(value) else DASH


def rotate_list(items: Sequence[T], by: int) -> list[T]:
    """``items`` rotated left by ``by``: interleaved runs start with a different contender."""
    by %= len(items)
    return [*items[by:], *items[:by]]


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table."""
    lines = [f"| {' | '.join(header)} |", f"|{'|'.join('---' for _ in header)}|"]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return lines


# -- servers -----------------------------------------------------------------------------


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str, poll: float = 0.01) -> T:
    """Poll ``predicate`` until it returns something truthy, or fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)


@contextlib.contextmanager
def postgres() -> Iterator[str]:
    """``PGLOCK_DSN``, or a private embedded server for the run."""
    dsn = os.environ.get("PGLOCK_DSN", "").strip()
    if dsn:
        yield dsn
        return
    from celery_pglock.testing.embedded import EmbeddedPostgres  # noqa: PLC0415

    with EmbeddedPostgres() as server:
        server.start()
        yield server.dsn


@contextlib.contextmanager
def private_schema(dsn: str, tag: str = "bench") -> Iterator[str]:
    """A new schema holding our tables, dropped afterwards."""
    name = f"{tag}_{RUN_ID}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        ensure_schema(conn, Tables(name), auto_migrate=True)
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def redis_base() -> str:
    url = os.environ.get("BENCH_REDIS_URL") or os.environ.get("PGLOCK_TEST_REDIS_URL") or ""
    return url.strip().rstrip("/").rsplit("/", 1)[0] if url.count("/") > 2 else DEFAULT_REDIS


def pick_redis_db(base: str) -> int:
    """An empty Redis database number, highest first (keeps clear of the usual 0)."""
    for number in range(15, 0, -1):
        client = redis.Redis.from_url(f"{base}/{number}")
        try:
            if client.dbsize() == 0:
                return number
        finally:
            client.close()
    raise RuntimeError(f"no empty Redis database at {base}")


def clean_redis(url: str, patterns: Sequence[str]) -> int:
    """Delete the keys of this run (by pattern) from the database at ``url``."""
    client = redis.Redis.from_url(url)
    deleted = 0
    try:
        for pattern in patterns:
            keys = list(client.scan_iter(match=pattern, count=1000))
            for start in range(0, len(keys), 500):
                deleted += int(client.delete(*keys[start : start + 500]))
    finally:
        client.close()
    return deleted


# -- processes ---------------------------------------------------------------------------


def start_process(
    argv: Sequence[str], log: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session (so its children can be stopped with it)."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            env=full_env,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )


def celery(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", *args]


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(c) for c in (task / "children").read_text().split()]
    return found


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    """SIGTERM ``proc`` (SIGCONT first, in case it is stopped); SIGKILL what is left of it."""
    left = children(proc.pid) if proc.poll() is None else []
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for pid in left:  # prefork children that outlived their parent, by pid
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getsid(pid) == proc.pid:
                os.kill(pid, signal.SIGKILL)


_OWNER = re.compile(r"^(?:celery-pglock[^@]* (\d+)@|pglock (\d+) )")


def owner(application_name: str | None) -> int | None:
    """The client pid our sessions put in ``application_name`` (pool, holder, beat, floor)."""
    match = _OWNER.match(application_name or "")
    return int(match.group(1) or match.group(2)) if match else None


def rss_kib(pid: int) -> int:
    """Resident set size of ``pid`` in KiB (0 once gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def empty_broker(default: str) -> str:
    """``BENCH_BROKER_URL`` (else ``default``); refuses one that holds keys (we empty it)."""
    broker = os.environ.get("BENCH_BROKER_URL") or default
    if redis.Redis.from_url(broker).dbsize():
        raise SystemExit(f"{broker} is not empty: choose an empty database (BENCH_BROKER_URL)")
    return broker


@dataclass(frozen=True)
class Target:
    """A row of docs/benchmarks.md's targets table."""

    measure: str
    target: str
    result: str
    met: bool | None  # None: not measured in this run

    def row(self) -> list[str]:
        verdict = {True: "met", False: "**missed**", None: "not measured"}[self.met]
        return [self.measure, self.target, self.result, verdict]


def write_section(
    docs: Path, title: str, lines: Sequence[str], row_prefix: str, targets: Sequence[Target]
) -> None:
    """Replace (or add) the ``## title`` section of ``docs`` and, in its targets table, the
    rows starting with ``row_prefix`` (e.g. ``"| 9. "``): a benchmark run alone."""
    text = replace_section(docs.read_text(), title, lines)
    kept = [line for line in text.splitlines() if not line.startswith(row_prefix)]
    rows = [f"| {' | '.join(t.row())} |" for t in targets]
    start = kept.index("| measure | target | result |  |")
    end = next(i for i in range(start, len(kept)) if not kept[i].startswith("|"))
    docs.write_text("\n".join([*kept[:end], *rows, *kept[end:]]).rstrip("\n") + "\n")


def replace_section(text: str, title: str, lines: Sequence[str]) -> str:
    """``text`` (a markdown page) with its ``## title`` section replaced by ``lines``, or
    with the section added at the end."""
    heading = f"## {title}"
    body = "\n".join([heading, "", *lines, ""])
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        return pattern.sub(lambda _: body + "\n", text)
    return text + "\n" + body
