"""CPU time actually spent, per process, in nanoseconds (Linux ``schedstat``).

Wall-clock times on a shared 2-core machine move with everybody else's load; the CPU
time a batch of tasks consumed (in the worker processes, their PostgreSQL backends, the
Redis server and the publishing thread) moves much less, and is what a deployment pays.
``/proc/<pid>/task/<tid>/schedstat`` counts nanoseconds on a CPU per thread.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from pathlib import Path

import psycopg
import redis

from benchmarks import common


def process_ns(pid: int) -> int:
    """CPU nanoseconds used so far by every thread of ``pid`` (0 once it is gone)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            total += int((task / "schedstat").read_text().split()[0])
    return total


def total_ns(pids: Iterable[int]) -> int:
    return sum(process_ns(pid) for pid in pids)


def backends(conn: psycopg.Connection[tuple[int, str]], owners: set[int]) -> list[int]:
    """PostgreSQL backend pids whose ``application_name`` names one of ``owners``."""
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
    ).fetchall()
    return [pid for pid, name in rows if common.owner(name) in owners]


def redis_pid(url: str) -> int | None:
    """The Redis server's pid when it runs on this machine, else None."""
    client = redis.Redis.from_url(url)
    try:
        pid = int(client.info("server").get("process_id", 0))
    finally:
        client.close()
    return pid if pid and Path(f"/proc/{pid}").exists() else None
