"""Through PgBouncer: transaction pooling holds session-scope locks on rows, session pooling
takes advisory locks; asked for advisory locks, transaction pooling refuses them loudly.

One run against the shared PostgreSQL through one PgBouncer serving a transaction-pooling
and a session-pooling database. A worker on each (transaction pooling: locks on rows, by
``pglock_lock_backend = "auto"``), one more on transaction pooling asked for advisory
locks, a beat replica on session pooling (its leader lock a session lock) and one on
transaction pooling (elected on rows: a mixed fleet, one leader), and a beat replica
asked for advisory locks on transaction pooling, which refuses to start.
"""

from __future__ import annotations

import json
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
ADVISORY = json.dumps({"pglock_lock_backend": "advisory"})


def jobs(w: Workload, task: str, queue: str, label: str) -> list[Sent]:
    """JOBS slots of ``task``, each sent twice."""
    sent: list[Sent] = []
    for _ in range(JOBS):
        sent += w.send(w.key(label), slot=SLOT, copies=2, task=task, queue=queue)
    return sent


@pytest.fixture(scope="module")
def run(pg_dsn: str, redis_url: str, run_procs: Procs) -> Iterator[Run]:
    """Workers behind both pool modes, beats behind both, the checker."""
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
        tx_queue, advisory_queue = (w.env["TEST_QUEUE"] + suffix for suffix in ("-tx", "-adv"))
        tx_worker = w.worker("tx", queue=tx_queue, PGLOCK_DSN=tx_dsn)
        advisory_worker = w.worker(
            "adv", queue=advisory_queue, PGLOCK_DSN=tx_dsn, TEST_PGLOCK_CONF=ADVISORY
        )
        w.worker("session")
        w.beat("session")
        result.facts["beat-rows"] = w.beat("tx", lead=None, PGLOCK_DSN=tx_dsn)
        refused = run_procs.celery(
            "tests.faults.faultapp",
            "beat",
            "-l",
            "info",
            env={**w.env, "TEST_BEAT_EVERY": "1", "PGLOCK_DSN": tx_dsn}
            | {"TEST_PGLOCK_CONF": ADVISORY},
            name="beat-advisory",
        )
        result.facts["beat-advisory"] = (refused.wait(EXIT_TIMEOUT), refused.log_text())
        result.facts["tx"] = jobs(w, "faults.job_tx", tx_queue, "tx-tx") + jobs(
            w, "faults.job", tx_queue, "tx-s"
        )
        result.facts["advisory"] = w.send(w.key("adv-s"), slot=SLOT, queue=advisory_queue)
        result.facts["session"] = jobs(w, "faults.job", w.env["TEST_QUEUE"], "s-s") + jobs(
            w, "faults.job_tx", w.env["TEST_QUEUE"], "s-tx"
        )
        w.settle(w.sent)
        result.facts["tx-worker"] = tx_worker
        result.facts["advisory-worker"] = advisory_worker
        w.stop()
        bouncer.stop()  # its server connections carry our application_name
        result.report = w.check()
        yield result
    finally:
        w.drop()


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""


def test_session_scope_through_transaction_pooling_runs_each_slot_once_on_rows(
    run: Run,
) -> None:
    """Both scopes work through transaction pooling: each slot once, its copy skipped;
    session scope holds its locks on rows."""
    sent: list[Sent] = run.facts["tx"]
    states = sorted(s.result.state for s in sent)
    assert ["SKIPPED"] * 2 * JOBS + ["SUCCESS"] * 2 * JOBS == states


def test_worker_behind_transaction_pooling_says_it_holds_locks_on_rows(run: Run) -> None:
    """The worker says at start-up which backend its locks use, and why."""
    worker: Proc = run.facts["tx-worker"]
    line = next(text for text in worker.log_text().splitlines() if "session-scope locks on" in text)
    assert "locks on rows" in line
    assert "a transaction pooler stands between this process and PostgreSQL" in line


def test_advisory_locks_asked_for_through_transaction_pooling_fail_naming_the_fix(
    run: Run,
) -> None:
    """``pglock_lock_backend = "advisory"`` behind transaction pooling: a session-scope task
    fails, naming the setting that fixes it, and the worker said so at start-up."""
    [sent] = run.facts["advisory"]
    assert ("FAILURE", "ConfigurationError") == (
        sent.result.state,
        type(sent.result.result).__name__,
    )
    assert 'pglock_lock_backend = "auto"' in str(sent.result.result)
    assert [] == [r for r in run.workload.executions() if r["lock_name"] == sent.lock]
    worker: Proc = run.facts["advisory-worker"]
    line = next(text for text in worker.log_text().splitlines() if "transaction pooler" in text)
    assert ("faults.job," in line, "faults.job_tx" in line) == (True, False)


def test_session_pooling_runs_both_scopes_once(run: Run) -> None:
    """Through session pooling, session and transaction scope both run each slot once."""
    sent: list[Sent] = run.facts["session"]
    states = sorted(s.result.state for s in sent)
    assert ["SKIPPED"] * 2 * JOBS + ["SUCCESS"] * 2 * JOBS == states


def test_beat_through_transaction_pooling_stands_by_on_rows(run: Run) -> None:
    """A beat replica behind transaction pooling elects on rows and, while the replica on
    session pooling leads by an advisory lock, sends nothing itself (one leader)."""
    beat: Proc = run.facts["beat-rows"]
    log = beat.log_text()
    assert "beat leader election on rows" in log
    assert [] == [seen for seen in ("is now the leader", "Sending due task") if seen in log]


def test_advisory_beat_through_transaction_pooling_refuses_to_start(run: Run) -> None:
    """Asked for advisory locks behind transaction pooling, a leader-electing beat exits 1
    at once, in one line naming the fix, without a traceback or an attempt retried."""
    status, log = run.facts["beat-advisory"]
    assert (1, 1) == (status, log.count("cannot start:")), log
    assert 'pglock_lock_backend = "auto"' in log
    assert [] == [seen for seen in ("Sending due task", "Traceback", "waiting for") if seen in log]
