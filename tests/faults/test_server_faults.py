"""Faults of the PostgreSQL server itself, injected into one run on a server of its own.

One worker (3 processes) and one beat replica (every second) run jobs through, in turn:
a lock holder's backend terminated mid-task (``pg_terminate_backend``) while a duplicate
waits; a fast and an immediate restart with a job in flight; the server stopped for
longer than a slot interval with jobs arriving meanwhile; and a DBA's global
``idle_session_timeout`` / ``idle_in_transaction_session_timeout`` killing idle pooled
connections. Broker: Redis. The checker then looks at everything the run did.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import testapp
from tests.faults.workload import Invariants, Run, Sent, Workload
from tests.fixtures.procs import Procs, wait_until

# Run alone (serial): restarts and idle timeouts timed against heartbeats; recovery times measured
# alone, which other tests' load would distort.
pytestmark = [pytest.mark.faults, pytest.mark.serial]

SLOT = "2026-11-29T18:05:00Z"
OUTAGE = 2.5  # seconds the server stays down: longer than the 1-s slot interval
DBA_IDLE = "1s"
FAULT_DEADLINE = 30.0


def terminate_holder(w: Workload, facts: dict[str, Any]) -> None:
    """The holder's backend is terminated; a duplicate takes over; the holder cannot record."""
    gate, key = w.gate(), w.key("terminated")
    [holder] = w.send(key, slot=SLOT, gate=str(gate))
    w.running(key)
    [run] = [r for r in w.ledger() if r["lock_name"] == holder.lock]
    with psycopg.connect(w.admin_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (run["backend_pid"],))
    ended = time.monotonic()
    [duplicate] = w.send(key, slot=SLOT)
    w.settle([duplicate])
    gate.touch()
    w.settle([holder])
    facts["terminated"] = (holder, duplicate, run["token"])
    w.recovery("backend terminated -> next job succeeds", ended)


def restart_mid_task(
    w: Workload, server: EmbeddedPostgres, mode: str, facts: dict[str, Any]
) -> None:
    """Restart the server while a job holds its lock; it finishes after the restart."""
    gate, key = w.gate(), w.key(mode)
    [job] = w.send(key, slot=SLOT, gate=str(gate))
    w.running(key)
    server.restart(mode)
    back = time.monotonic()
    gate.touch()
    w.settle([job])
    facts[mode] = job
    w.recovery(f"{mode} restart -> next job succeeds", back)
    w.beat_recovery(f"{mode} restart -> next beat slot executed", back)


def stopped_outage(w: Workload, server: EmbeddedPostgres, facts: dict[str, Any]) -> None:
    """Stop the server for longer than a slot interval while jobs arrive; start it again."""
    server.stop("fast")
    down = time.monotonic()
    waiting = w.send(w.key("outage"), slot=SLOT, copies=2)
    wait_until(
        lambda: all(s.result.state == "RETRY" for s in waiting),
        timeout=FAULT_DEADLINE,
        message="jobs sent during the outage to be retried",
    )
    wait_until(lambda: time.monotonic() - down > OUTAGE, timeout=OUTAGE + 1, message="outage")
    server.start()
    back = time.monotonic()
    w.settle(waiting)
    facts["outage"] = waiting
    w.recovery("server stopped 2.5 s -> next job succeeds", back)
    w.beat_recovery("server stopped 2.5 s -> next beat slot executed", back)


def dba_idle_timeouts(w: Workload, server: EmbeddedPostgres, facts: dict[str, Any]) -> None:
    """A DBA sets both idle timeouts globally; a worker started afterwards keeps working.

    It has a queue of its own (beat keeps the first worker busy) and one pool process,
    whose pool holds 3 connections (grown, as under load); the server ends them all while
    idle; then jobs arrive, idle 1.5 s inside their lock.
    """
    server.set_config(idle_session_timeout=DBA_IDLE, idle_in_transaction_session_timeout=DBA_IDLE)
    queue = w.env["TEST_QUEUE"] + "-dba"
    worker = w.worker("dba", concurrency=1, queue=queue)
    [child] = worker.children()
    warm = testapp.app.send_task("faults.warm_pool", (3,), queue=queue)
    assert 3 == warm.get(timeout=FAULT_DEADLINE)
    wait_until(
        lambda: _pooled_sessions(w.admin_dsn, child) == 0,
        timeout=FAULT_DEADLINE,
        message="the server to end the idle pooled connections",
    )
    sent = w.send(w.key("dba"), slot=SLOT, copies=2, hold=1.5, queue=queue)
    sent += w.send(
        w.key("dba-tx"), slot=SLOT, copies=2, task="faults.job_tx", hold=1.5, queue=queue
    )
    w.settle(sent)
    facts["dba"] = (worker, sent)


def _pooled_sessions(dsn: str, pid: int) -> int:
    query = "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, (f"celery-pglock {pid}@%",)).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture(scope="module")
def run(redis_url: str, run_pg: EmbeddedPostgres, run_procs: Procs) -> Run:
    """The whole run: faults in turn, processes stopped, promises checked."""
    w = Workload(
        name="server",
        admin_dsn=run_pg.dsn,
        app_dsn=run_pg.dsn,
        redis_url=redis_url,
        procs=run_procs,
    )
    result = Run(w)
    w.prepare()
    w.worker("main", concurrency=3)
    w.beat()
    w.settle(w.send(w.key("warm"), slot=SLOT, copies=3))
    terminate_holder(w, result.facts)
    restart_mid_task(w, run_pg, "fast", result.facts)
    restart_mid_task(w, run_pg, "immediate", result.facts)
    stopped_outage(w, run_pg, result.facts)
    dba_idle_timeouts(w, run_pg, result.facts)
    w.stop()
    result.report = w.check()
    return result


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""

    min_slots = 11


def test_terminated_holder_is_superseded_and_cannot_record_success(run: Run) -> None:
    """A holder whose backend was terminated fails with LockLost; the duplicate's run counts."""
    holder, duplicate, holder_token = run.facts["terminated"]
    [ledger_row] = [r for r in run.workload.ledger() if r["lock_name"] == holder.lock]
    assert ("FAILURE", "LockLost") == (holder.result.state, type(holder.result.result).__name__)
    assert "SUCCESS" == duplicate.result.state
    assert duplicate.result.result > holder_token
    assert ("succeeded", duplicate.result.result) == (ledger_row["state"], ledger_row["token"])


@pytest.mark.parametrize("mode", ["fast", "immediate"])
def test_job_in_flight_across_a_restart_succeeds_once(run: Run, mode: str) -> None:
    """A job holding its lock through a restart records its success on a fresh connection."""
    job: Sent = run.facts[mode]
    [ledger_row] = [r for r in run.workload.ledger() if r["lock_name"] == job.lock]
    assert "SUCCESS" == job.result.state
    assert ("succeeded", job.result.result, 1) == (
        ledger_row["state"],
        ledger_row["token"],
        ledger_row["attempts"],
    )


def test_jobs_sent_while_the_server_is_down_wait_then_run_once(run: Run) -> None:
    """Jobs arriving during an outage are retried, none runs meanwhile, one runs after."""
    waiting: list[Sent] = run.facts["outage"]
    ran = [r for r in run.workload.executions() if r["lock_name"] == waiting[0].lock]
    assert ["SKIPPED", "SUCCESS"] == sorted(s.result.state for s in waiting)
    assert [waiting[0].slot] == [r["slot"] for r in ran]


def test_dba_idle_timeouts_cost_no_retry(run: Run) -> None:
    """With global idle timeouts, dead pooled connections are replaced without a task retry."""
    worker, sent = run.facts["dba"]
    assert ["SKIPPED", "SKIPPED", "SUCCESS", "SUCCESS"] == sorted(s.result.state for s in sent)
    assert "will be retried" not in worker.log_text()
