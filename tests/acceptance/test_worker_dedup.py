"""Duplicate deliveries to real prefork workers: one run, the rest SKIPPED with the reason.

Every test gets its own schema, queue and lock namespace (advisory locks are
database-wide), and asserts on what ran (``executions``), the run ledger and task states.
Gated tasks (``harness.Gate``) keep a run going until the test lets it finish.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest
from celery.result import AsyncResult

from celery_pglock import SKIPPED
from tests.apps import testapp
from tests.apps.harness import (
    DEADLINE,
    SLOT,
    SLOTTED,
    Gate,
    app_env,
    configure_client,
    database_result_backend,
    executions,
    executions_when,
    ledger,
    redis_result_backend,
    start_workers,
)
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance


def worker_env(pg_dsn: str, schema: str, broker_url: str, backend_url: str) -> dict[str, str]:
    return app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        broker_url=broker_url,
        backend_url=backend_url,
        TEST_NAMESPACE=schema,
    )


def states(results: list[AsyncResult[Any]]) -> list[str]:
    return [result.state for result in results]


@pytest.mark.parametrize(
    ("broker_url", "backend"),
    [("redis", "redis"), ("redis", "database"), ("rabbitmq", "redis"), ("rabbitmq", "database")],
    indirect=["broker_url"],
)
def test_same_slot_delivered_eight_times_runs_once(
    *, broker_url: str, backend: str, redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """One slot sent 8 times to 2 workers x 4 processes: 1 run, 7 SKIPPED 'locked' naming it."""
    if backend == "redis":
        backend_url = redis_result_backend(redis_url)
    else:
        backend_url = database_result_backend(pg_dsn)
    env = worker_env(pg_dsn, pglock_schema, broker_url, backend_url)
    configure_client(env)
    start_workers(procs, env, 2, concurrency=4)

    with Gate(pg_dsn) as gate:
        results = [testapp.gated.apply_async((gate.id,), headers=SLOTTED) for _ in range(8)]
        wait_until(
            lambda: states(results).count(SKIPPED) == 7,
            timeout=DEADLINE,
            interval=0.2,
            message="7 of 8 deliveries SKIPPED",
        )
        # Ready and returned at once, while the one run is still held at the gate.
        skips = [result.get(timeout=5) for result in results if result.state == SKIPPED]
        [running] = wait_until(
            lambda: executions_when(pg_dsn, pglock_schema, 1),
            timeout=DEADLINE,
            message="the one run",
        )
    [holder] = [result for result in results if result.state != SKIPPED]

    assert holder.get(timeout=DEADLINE) == running["token"]
    assert holder.id == running["task_id"]
    for meta in skips:
        assert meta["reason"] == "locked"
        assert (meta["lock"], meta["slot"]) == (f"{pglock_schema}:testapp.gated", SLOT)
        assert meta["holder"]["task_id"] == holder.id
        assert meta["holder"]["pid"] == running["pid"]
        assert meta["holder"]["host"] == socket.gethostname()
        assert meta["holder"]["since"]
    assert [holder.id] == [row["task_id"] for row in executions(pg_dsn, pglock_schema)]
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 1, holder.id) == (run["state"], run["attempts"], run["task_id"])


def test_duplicate_after_success_is_skipped_as_done(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """A duplicate of a slot that already succeeded is SKIPPED 'done', naming the run."""
    env = worker_env(pg_dsn, pglock_schema, redis_url, redis_result_backend(redis_url))
    configure_client(env)
    start_workers(procs, env, 1, concurrency=2)
    first = testapp.gated.apply_async((None,), headers=SLOTTED)
    token = first.get(timeout=DEADLINE)

    late = testapp.gated.apply_async((None,), headers=SLOTTED)
    meta = late.get(timeout=DEADLINE)

    assert late.state == SKIPPED
    assert (meta["reason"], meta["token"]) == ("done", token)
    assert meta["holder"]["task_id"] == first.id
    assert [first.id] == [row["task_id"] for row in executions(pg_dsn, pglock_schema)]
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 1, first.id) == (run["state"], run["attempts"], run["task_id"])


def test_scheduled_only_runs_ad_hoc_messages_in_parallel(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """pglock_scheduled_only: messages without a slot run side by side, unlocked."""
    env = worker_env(pg_dsn, pglock_schema, redis_url, redis_result_backend(redis_url))
    configure_client(env)
    start_workers(procs, env, 1, concurrency=3)

    with Gate(pg_dsn) as gate:
        results = [testapp.gated_scheduled_only.apply_async((gate.id,)) for _ in range(3)]
        # All three get inside the body while none can finish: they overlap.
        running = wait_until(
            lambda: executions_when(pg_dsn, pglock_schema, 3),
            timeout=DEADLINE,
            message="3 overlapping executions",
        )

    assert [row["finished"] for row in running] == [None, None, None]
    assert len({row["pid"] for row in running}) == 3
    assert [result.get(timeout=DEADLINE) for result in results] == [None, None, None]
    assert [row["token"] for row in executions(pg_dsn, pglock_schema)] == [None, None, None]
    assert ledger(pg_dsn, pglock_schema) == []


def test_scheduled_only_locks_slotted_messages(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """pglock_scheduled_only: messages carrying a slot are locked, duplicates SKIPPED."""
    env = worker_env(pg_dsn, pglock_schema, redis_url, redis_result_backend(redis_url))
    configure_client(env)
    start_workers(procs, env, 1, concurrency=3)

    with Gate(pg_dsn) as gate:
        task = testapp.gated_scheduled_only
        results = [task.apply_async((gate.id,), headers=SLOTTED) for _ in range(3)]
        wait_until(
            lambda: states(results).count(SKIPPED) == 2,
            timeout=DEADLINE,
            interval=0.2,
            message="2 of 3 slotted messages SKIPPED",
        )
    [holder] = [result for result in results if result.state != SKIPPED]

    token = holder.get(timeout=DEADLINE)
    assert [(holder.id, token)] == [
        (row["task_id"], row["token"]) for row in executions(pg_dsn, pglock_schema)
    ]
    assert token is not None
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", holder.id) == (run["state"], run["task_id"])
