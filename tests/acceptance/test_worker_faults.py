"""Faults under real prefork workers: a killed child, a frozen holder, a vanished database.

Every test gets its own schema, queue and lock namespace (advisory locks are
database-wide), and asserts on what ran (``executions``), the run ledger, fenced writes
and task states. Gated tasks (``harness.Gate``) keep a run going until the test lets it
finish, so the fault always hits a run in progress.
"""

from __future__ import annotations

import os
import signal

import psycopg
import pytest

from celery_pglock import StaleToken
from tests.apps import testapp
from tests.apps.harness import (
    DEADLINE,
    LONG_LEASE,
    SLOTTED,
    Gate,
    app_env,
    configure_client,
    executions,
    executions_when,
    kill_running_child,
    ledger,
    observations,
    redis_app_env,
    redis_result_backend,
    start_workers,
    writes,
)
from tests.fixtures.procs import Procs, wait_until
from tests.fixtures.proxy import ProxyFactory
from tests.fixtures.services import all_brokers

pytestmark = pytest.mark.acceptance

SHORT_LEASE = 2  # seconds: the frozen holder's lock is gone soon after


def backend_alive(dsn: str, backend_pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        return conn.execute(query, (backend_pid,)).fetchone() is not None


@all_brokers
def test_killed_child_message_is_redelivered_and_runs_once(
    broker_url: str, redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """acks_late: a SIGKILLed child's message is redelivered, relocked at once, run once."""
    env = app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        broker_url=broker_url,
        backend_url=redis_result_backend(redis_url),
        TEST_NAMESPACE=pglock_schema,
        TEST_ACKS_LATE="1",
        TEST_LEASE=LONG_LEASE,
    )
    configure_client(env)
    [worker] = start_workers(procs, env, 1, concurrency=2)

    with Gate(pg_dsn) as gate:
        result = testapp.gated.apply_async((gate.id,), headers=SLOTTED)
        killed = kill_running_child(pg_dsn, pglock_schema, worker)
        # The redelivered run takes the lock (a held lock would make it SKIPPED) long
        # before the dead holder's lease could have expired.
        rows = wait_until(
            lambda: executions_when(pg_dsn, pglock_schema, 2),
            timeout=DEADLINE,
            message="the redelivered run",
        )

    rerun = rows[1]
    assert result.get(timeout=DEADLINE) == rerun["token"]
    assert [result.id, result.id] == [row["task_id"] for row in rows]
    assert rerun["token"] > killed["token"]
    assert [row["finished"] is None for row in executions(pg_dsn, pglock_schema)] == [True, False]
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 2, rerun["token"]) == (run["state"], run["attempts"], run["token"])


def test_frozen_holder_loses_lock_and_its_fenced_write_is_rejected(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """A holder frozen past its lease is superseded; on waking it sees 'lost', fence rejects it."""
    env_a = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
        TEST_LEASE=SHORT_LEASE,
    )
    env_b = {**env_a, "TEST_QUEUE": env_a["TEST_QUEUE"] + "-b"}  # B: another worker
    configure_client(env_a)
    start_workers(procs, env_a, 1)
    start_workers(procs, env_b, 1)

    with Gate(pg_dsn) as gate:
        a = testapp.fenced_gated.apply_async((gate.id, "A"), headers=SLOTTED)
        [a_run] = wait_until(
            lambda: executions(pg_dsn, pglock_schema), timeout=DEADLINE, message="A running"
        )
        [a_claim] = ledger(pg_dsn, pglock_schema)
        os.kill(a_run["pid"], signal.SIGSTOP)  # a GC pause: A's heartbeat stops too
        try:
            wait_until(
                lambda: not backend_alive(pg_dsn, a_claim["backend_pid"]),
                timeout=DEADLINE,
                message="the server to end the frozen holder's session",
            )
            b = testapp.fenced_gated.apply_async(
                (None, "B"), headers=SLOTTED, queue=env_b["TEST_QUEUE"]
            )
            b_outcome = b.get(timeout=DEADLINE)
        finally:
            gate.open()
            os.kill(a_run["pid"], signal.SIGCONT)

    wait_until(a.ready, timeout=DEADLINE, message="A to finish")
    assert b_outcome == {"token": a_run["token"] + 1, "lost": False}
    assert a.state == "FAILURE"
    assert isinstance(a.result, StaleToken)
    assert (a.result.token, a.result.newest) == (a_run["token"], a_run["token"] + 1)
    seen = {row["task_id"]: row for row in observations(pg_dsn, pglock_schema)}
    assert (seen[a.id]["token"], seen[a.id]["lost"]) == (a_run["token"], True)
    assert (seen[b.id]["token"], seen[b.id]["lost"]) == (a_run["token"] + 1, False)
    assert writes(pg_dsn, pglock_schema) == [(a_run["token"] + 1, "B")]
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 2, b.id) == (run["state"], run["attempts"], run["task_id"])


def test_database_outage_at_task_time_retries_until_it_is_back(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs, tcp_proxy: ProxyFactory
) -> None:
    """PostgreSQL unreachable when a task starts: the task is retried, then runs once, locked."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    env = redis_app_env(
        pg_dsn=proxy.proxied_dsn(pg_dsn),
        schema=pglock_schema,
        redis_url=redis_url,
    )
    configure_client(env)
    start_workers(procs, env, 1)

    proxy.blackhole()  # no new connection is answered...
    proxy.cut()  # ...and the pooled ones are gone
    result = testapp.gated.apply_async((None,), headers=SLOTTED)
    wait_until(lambda: result.state == "RETRY", timeout=DEADLINE, message="a RETRY state")
    ran_during_outage = executions(pg_dsn, pglock_schema)
    proxy.restore()

    token = result.get(timeout=DEADLINE)
    assert ran_during_outage == []
    assert [(result.id, token)] == [
        (row["task_id"], row["token"]) for row in executions(pg_dsn, pglock_schema)
    ]
    assert token is not None
    [run] = ledger(pg_dsn, pglock_schema)
    assert ("succeeded", 1) == (run["state"], run["attempts"])


ROUNDS = 4
HOLDERS = 3


def running_rows(dsn: str, schema: str, slots: list[str]) -> list[dict[str, object]]:
    """The ledger rows of ``slots`` once every one of them is running, else []."""
    rows = [row for row in ledger(dsn, schema) if row["slot"] in slots]
    running = [row for row in rows if row["state"] == "running"]
    return running if len(running) == len(slots) else []


def test_every_thawed_holder_whose_session_ended_sees_lost_before_writing(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """4 rounds of 3 holders SIGSTOPped past their lease, then SIGCONTed together: each
    one's check() says lost (its heartbeat wakes at the same moment and must not make
    the check read "held")."""
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
        TEST_LEASE=SHORT_LEASE,
    )
    configure_client(env)
    start_workers(procs, env, 1, concurrency=HOLDERS)

    for round_number in range(ROUNDS):
        slots = [f"2026-12-01T08:0{round_number}:0{n}Z" for n in range(HOLDERS)]
        with Gate(pg_dsn) as gate:
            results = [  # one lock each, so that all of them hold at once
                testapp.keyed_observed.apply_async(
                    (f"{pglock_schema}:{n}",), {"gate": gate.id}, headers={"pglock_slot": slot}
                )
                for n, slot in enumerate(slots)
            ]
            running = wait_until(
                lambda slots=slots: running_rows(pg_dsn, pglock_schema, slots),
                timeout=DEADLINE,
                message=f"round {round_number}: {HOLDERS} holders running",
            )
            pids = [row["pid"] for row in running]
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            try:
                wait_until(
                    lambda running=running: (
                        not any(backend_alive(pg_dsn, row["backend_pid"]) for row in running)
                    ),
                    timeout=DEADLINE,
                    message="the server to end every frozen holder's session",
                )
                gate.open()
            finally:
                for pid in pids:
                    os.kill(pid, signal.SIGCONT)
        for result in results:
            wait_until(result.ready, timeout=DEADLINE, message="a thawed holder to finish")

    seen = observations(pg_dsn, pglock_schema)
    assert HOLDERS * ROUNDS == len(seen)
    assert [] == [row for row in seen if not row["lost"]]
