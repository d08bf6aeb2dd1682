"""Every worker pool runs as many locked tasks at once as its concurrency, with defaults.

A real ``celery worker -P <pool>`` per test. Tasks run as threads or greenlets of one
process (threads, gevent, eventlet) share that process's lock connections, which are
sized to the worker's concurrency; prefork children and solo run one task at a time.
Each task holds its own lock (a key per task) for a second and until the test, having
seen every one of them running at once, opens the gate. A task that found no connection
in time would be retried: the worker log would say ``will be retried``.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from celery.result import AsyncResult

from tests.apps import poolapp
from tests.apps.harness import (
    WORKER_READY_TIMEOUT,
    Gate,
    configure_client,
    executions,
    executions_when,
    redis_app_env,
)
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.acceptance

DEADLINE = 60.0  # seconds; generous, the machine runs other suites meanwhile
RETRIED = ("will be retried", "Retry in", "no PostgreSQL connection within")

POOLS = [
    # pool, concurrency, connections a process may open (the INFO line at start-up)
    ("prefork", 2, 4),
    ("solo", 1, 4),
    ("threads", 8, 9),
    ("gevent", 8, 9),
    ("eventlet", 8, 9),
]


def start_worker(
    procs: Procs, env: dict[str, str], pool: str, concurrency: int, **extra: str
) -> Proc:
    """One ``celery worker -P pool -c concurrency`` of ``tests.apps.poolapp``, ready."""
    node = f"{pool}-{env['TEST_QUEUE']}"
    proc = procs.celery(
        "tests.apps.poolapp",
        "worker",
        *("-P", pool, "-c", str(concurrency), "-n", f"{node}@%h"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        *("-l", "info", "-Q", env["TEST_QUEUE"]),
        env={**env, **extra},
        name=node,
    )
    proc.wait_for_log(f"{node}@{socket.gethostname()} ready.", timeout=WORKER_READY_TIMEOUT)
    return proc


def retried(proc: Proc) -> list[str]:
    """The worker's log lines about a task retried (or about to be) for want of PostgreSQL."""
    return [line for line in proc.log_text().splitlines() if any(s in line for s in RETRIED)]


def send(env: dict[str, str], count: int, **kwargs: Any) -> list[AsyncResult[Any]]:
    """``count`` ``poolapp.hold`` messages, each locked on a key of its own."""
    return [poolapp.hold.apply_async((f"{env['TEST_SCHEMA']}:k{i}",), kwargs) for i in range(count)]


@pytest.mark.parametrize(("pool", "concurrency", "connections"), POOLS, ids=[p[0] for p in POOLS])
def test_concurrency_locked_tasks_at_once_run_without_retries(
    *,
    pool: str,
    concurrency: int,
    connections: int,
    redis_url: str,
    pg_dsn: str,
    pglock_schema: str,
    procs: Procs,
) -> None:
    """concurrency x 1-second locked tasks at once, default settings: all run, none retried."""
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
    )
    configure_client(env)
    worker = start_worker(procs, env, pool, concurrency)

    with Gate(pg_dsn) as gate:
        results = send(env, concurrency, seconds=1.0, gate=gate.id)
        # Every one holds its lock at the same time: none waits for a connection.
        running = wait_until(
            lambda: executions_when(pg_dsn, pglock_schema, concurrency),
            timeout=DEADLINE,
            interval=0.2,
            message=f"{concurrency} tasks running at once",
        )
    tokens = [result.get(timeout=DEADLINE) for result in results]

    assert [None] * concurrency == [row["finished"] for row in running]
    assert all(isinstance(token, int) for token in tokens)
    assert sorted(r.id for r in results) == sorted(
        row["task_id"] for row in executions(pg_dsn, pglock_schema)
    )
    assert [] == retried(worker)
    assert (
        f"opens at most {connections} PostgreSQL connections for locks "
        f"(pool {pool}, concurrency {concurrency}"
    ) in worker.log_text()
    assert "pglock_pool_size = " not in worker.log_text()  # no warning with the default
    # psycopg's waits yield to greenlets under gevent, not under eventlet: said at start-up.
    assert (pool == "eventlet") == ("PSYCOPG_WAIT_FUNC=wait_select" in worker.log_text())


def test_explicit_pool_size_below_concurrency_warns_and_hands_connections_over(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """pglock_pool_size=4 on 8 threads: a WARNING naming the fix; 8 tasks share 4, none retried."""
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
    )
    configure_client(env)
    worker = start_worker(procs, env, "threads", 8, TEST_POOL_SIZE="4")

    results = send(env, 8, seconds=1.0)
    tokens = [result.get(timeout=DEADLINE) for result in results]

    assert all(isinstance(token, int) for token in tokens)
    assert 8 == len(executions(pg_dsn, pglock_schema))
    assert [] == retried(worker)
    log = worker.log_text()
    [warning] = [line for line in log.splitlines() if "pglock_pool_size = 4 is below" in line]
    assert "WARNING" in warning
    assert "concurrency (8, pool threads)" in warning
    assert "set it to at least 9" in warning
    assert "opens at most 4 PostgreSQL connections for locks (pool threads" in log
