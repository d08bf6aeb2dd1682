"""Through PgBouncer: transaction pooling refuses session-scope locks, session pooling takes both.

One run against the shared PostgreSQL through one PgBouncer serving a transaction-pooling
and a session-pooling database. A worker on each, a beat replica on session pooling (the
leader lock is a session lock), and a beat replica tried on transaction pooling.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.pgbouncer import PgBouncer, started
from tests.faults.workload import Invariants, Run, Sent, Workload
from tests.fixtures.procs import Proc, Procs

# Run alone (serial): beside other tests the worker's start-up check for a transaction
# pooler (a second client given the first one's backend) once found none, and the start-up
# line this module checks was missing; PgBouncer's hand-over of server connections is
# timing, which other tests' load distorts.
pytestmark = [pytest.mark.faults, pytest.mark.serial]

SLOT = "2026-11-29T18:05:00Z"
JOBS = 8  # slots per task and pool mode: more than psycopg's prepare threshold (5)
EXIT_TIMEOUT = 30.0


def jobs(w: Workload, task: str, queue: str, label: str) -> list[Sent]:
    """JOBS slots of ``task``, each sent twice."""
    sent: list[Sent] = []
    for _ in range(JOBS):
        sent += w.send(w.key(label), slot=SLOT, copies=2, task=task, queue=queue)
    return sent


@pytest.fixture(scope="module")
def run(pg_dsn: str, redis_url: str, run_procs: Procs) -> Iterator[Run]:
    """Workers behind both pool modes, beat behind session pooling, the checker."""
    with started(pg_dsn, run_procs.log_dir / "pgbouncer.log") as bouncer:
        yield from _run_behind(bouncer, pg_dsn, redis_url, run_procs)


def _run_behind(bouncer: PgBouncer, pg_dsn: str, redis_url: str, run_procs: Procs) -> Iterator[Run]:
    """``run`` behind ``bouncer``, which the fixture stops after it."""
    tx_dsn, session_dsn = bouncer.dsn_for("tx"), bouncer.dsn_for("session")
    w = Workload(
        name="bouncer", admin_dsn=pg_dsn, app_dsn=session_dsn, redis_url=redis_url, procs=run_procs
    )
    result = Run(w)
    try:
        w.prepare()
        tx_queue = w.env["TEST_QUEUE"] + "-tx"
        tx_worker = w.worker("tx", queue=tx_queue, PGLOCK_DSN=tx_dsn)
        w.worker("session")
        w.beat("session")
        refused = run_procs.celery(
            "tests.faults.faultapp",
            "beat",
            "-l",
            "info",
            env={**w.env, "TEST_BEAT_EVERY": "1", "PGLOCK_DSN": tx_dsn},
            name="beat-tx",
        )
        result.facts["beat-tx"] = (refused.wait(EXIT_TIMEOUT), refused.log_text())
        result.facts["tx"] = jobs(w, "faults.job_tx", tx_queue, "tx-tx")
        result.facts["tx-session"] = w.send(w.key("tx-s"), slot=SLOT, queue=tx_queue)
        result.facts["session"] = jobs(w, "faults.job", w.env["TEST_QUEUE"], "s-s") + jobs(
            w, "faults.job_tx", w.env["TEST_QUEUE"], "s-tx"
        )
        w.settle(w.sent)
        result.facts["tx-worker"] = tx_worker
        w.stop()
        bouncer.stop()  # its server connections carry our application_name
        result.report = w.check()
        yield result
    finally:
        w.drop()


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""


def test_session_scope_through_transaction_pooling_fails_naming_the_fix(run: Run) -> None:
    """A session-scope task behind transaction pooling fails, saying to use transaction scope."""
    [sent] = run.facts["tx-session"]
    assert ("FAILURE", "ConfigurationError") == (
        sent.result.state,
        type(sent.result.result).__name__,
    )
    assert 'pglock_scope = "transaction"' in str(sent.result.result)
    assert [] == [r for r in run.workload.executions() if r["lock_name"] == sent.lock]


def test_worker_behind_transaction_pooling_names_its_session_tasks_at_start(run: Run) -> None:
    """The worker says at start-up which of its tasks will refuse, and how to fix it."""
    worker: Proc = run.facts["tx-worker"]
    line = next(text for text in worker.log_text().splitlines() if "transaction pooler" in text)
    assert ("faults.job," in line, "faults.job_tx" in line) == (True, False)
    assert 'pglock_scope = "transaction"' in line


def test_transaction_scope_through_transaction_pooling_runs_each_slot_once(run: Run) -> None:
    """Transaction scope works through transaction pooling: each slot once, its copy skipped."""
    sent: list[Sent] = run.facts["tx"]
    states = sorted(s.result.state for s in sent)
    assert ["SKIPPED"] * JOBS + ["SUCCESS"] * JOBS == states


def test_session_pooling_runs_both_scopes_once(run: Run) -> None:
    """Through session pooling, session and transaction scope both run each slot once."""
    sent: list[Sent] = run.facts["session"]
    states = sorted(s.result.state for s in sent)
    assert ["SKIPPED"] * 2 * JOBS + ["SUCCESS"] * 2 * JOBS == states


def test_beat_leader_through_transaction_pooling_refuses_to_start(run: Run) -> None:
    """A leader-electing beat behind transaction pooling exits 1 at once, in one line
    naming the fixes, without a traceback or an attempt retried."""
    status, log = run.facts["beat-tx"]
    assert (1, 1) == (status, log.count("cannot start:")), log
    assert "pglock_beat_leader = False" in log
    assert [] == [seen for seen in ("Sending due task", "Traceback", "waiting for") if seen in log]
