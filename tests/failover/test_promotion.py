"""A real promotion under real workers and beat replicas (``tests.faults.faultapp``).

Every process is given the clients' multi-host DSN (``target_session_attrs=read-write``)
and is never restarted: after the primary is lost and the replica promoted, each finds
the new primary by itself. Each test checks its scenario, then the promises of every
fault run (``Workload.check``: no slot succeeded twice, everything resolved, nothing left
behind, no process died).
"""

from __future__ import annotations

import itertools
import time
from datetime import datetime, timedelta

import psycopg
import pytest
from psycopg import sql

from celery_pglock import StaleToken, fence
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.schema import Tables
from celery_pglock.store._database import Database, close_all
from tests.failover.conftest import Cluster
from tests.faults.workload import MEASUREMENTS, Report, Workload
from tests.fixtures.procs import Procs

# Run alone (serial): runs in flight across a promotion, whose timing other tests' load
# distorts (beside them a run's outcome, waiting for PostgreSQL, once met the promoting
# replica's closed connection and failed).
pytestmark = [pytest.mark.failover, pytest.mark.serial]

SLOT = "2026-12-01T03:00:00Z"
BEAT_LEASE = "3"


@pytest.fixture
def workload(cluster: Cluster, redis_url: str, procs: Procs) -> Workload:
    return start_workload(cluster, redis_url, procs)


@pytest.fixture
def sync_workload(sync_cluster: Cluster, redis_url: str, procs: Procs) -> Workload:
    return start_workload(sync_cluster, redis_url, procs)


def start_workload(cluster: Cluster, redis_url: str, procs: Procs) -> Workload:
    w = Workload(
        name="failover",
        admin_dsn=cluster.dsn,
        app_dsn=cluster.dsn,
        redis_url=redis_url,
        procs=procs,
        TEST_BEAT_LEASE=BEAT_LEASE,
        TEST_BEAT_CATCH_UP="all",
    )
    w.prepare()
    w.worker("main", concurrency=3)
    return w


def checked(w: Workload) -> Report:
    """Stop the processes (as an operator would) and check the promises of every run."""
    w.stop()
    report = w.check()
    assert ([], [], []) == (report.succeeded_twice, report.unresolved, report.unsettled)
    assert ([], [], []) == (report.held_locks, report.open_sessions, report.crashed)
    return report


def test_a_task_holding_its_lock_at_the_promotion_is_fenced_off(
    cluster: Cluster, workload: Workload
) -> None:
    """The holder learns its lock is lost; the redelivery of its slot runs on the new
    primary with a larger token; the holder's fenced write after that is refused."""
    w = workload
    gate, key = w.gate(), w.key("held")
    [holder] = w.send(key, slot=SLOT, task="faults.fenced_job", gate=str(gate))
    w.running(key)
    cluster.replica.wait_replayed()

    promoted = cluster.fail_over()
    [redelivery] = w.send(key, slot=SLOT, task="faults.fenced_job")
    w.settle([redelivery])
    MEASUREMENTS["failover: promotion -> first locked task run"] = time.monotonic() - promoted
    gate.touch()
    w.settle([holder])

    assert ("FAILURE", StaleToken) == (holder.result.state, type(holder.result.result))
    assert "SUCCESS" == redelivery.result.state
    [row] = [r for r in w.ledger() if r["lock_name"] == holder.lock]
    assert ("succeeded", redelivery.result.result) == (row["state"], row["token"])
    [held] = [e for e in w.executions() if e["lock_name"] == holder.lock and not e["finished"]]
    assert redelivery.result.result > held["token"]
    checked(w)


def test_a_run_finishing_before_the_promotion_records_its_outcome_on_the_new_primary(
    cluster: Cluster, workload: Workload
) -> None:
    """The primary is gone and the replica not promoted yet when the run ends: its outcome
    waits (the replica is read-only), then is written on the new primary; the row is final."""
    w = workload
    gate, key = w.gate(), w.key("finishing")
    [job] = w.send(key, slot=SLOT, gate=str(gate), via="early")
    w.wait_for(
        lambda: [r["state"] for r in w.ledger() if r["lock_name"] == job.lock] == ["running"],
        message="the job to run",
    )
    # The body records its execution after the claim: stopping the primary before that
    # write would fail the body itself, not the outcome's wait this test is about.
    w.wait_for(
        lambda: (
            [bool(e["finished"]) for e in w.executions() if e["lock_name"] == job.lock] == [True]
        ),
        message="the job to record its execution",
    )
    cluster.replica.wait_replayed()
    cluster.primary.stop("immediate")

    gate.touch()
    [worker] = w.workers
    w.wait_for(lambda: "waits for PostgreSQL" in worker.log_text(), message="the outcome to wait")
    cluster.replica.promote()
    w.settle([job])

    assert "SUCCESS" == job.result.state
    [row] = [r for r in w.ledger() if r["lock_name"] == job.lock]
    assert ("succeeded", job.result.result, 1) == (row["state"], row["token"], row["attempts"])
    checked(w)


def test_beat_and_workers_follow_a_synchronous_promotion_losing_no_slot(
    sync_cluster: Cluster, sync_workload: Workload
) -> None:
    """A leader and a standby tick every second; the primary crashes mid-run. A leader on
    the new primary sends on; the slots due during the gap are caught up; every slot ran
    once, and no success acknowledged before the crash is missing (synchronous replica)."""
    w = sync_workload
    w.beat("leader")
    w.beat("standby", lead=False)
    w.wait_for(lambda: len(w.executions("faults.periodic")) >= 3, message="3 beat slots")
    sent = w.send(w.key("before"), slot=SLOT, copies=3)
    w.settle(sent)

    promoted = sync_cluster.fail_over()
    w.beat_recovery("promotion -> first beat slot executed", promoted)
    after = w.send(w.key("after"), slot=SLOT, copies=3)
    w.settle(after)
    w.wait_for(lambda: len(w.executions("faults.periodic")) >= 8, message="8 beat slots")

    report = checked(w)
    assert ["SKIPPED", "SKIPPED", "SUCCESS"] * 2 == sorted(s.result.state for s in sent) + sorted(
        s.result.state for s in after
    )
    slots = sorted(
        datetime.fromisoformat(r["slot"]) for r in w.ledger() if r["task_name"] == "faults.periodic"
    )
    missing = [a for a, b in itertools.pairwise(slots) if b - a != timedelta(seconds=1)]
    assert [] == missing, "slots due during the failover were not caught up"
    assert report.slots >= 10


def test_a_cut_off_old_primary_is_never_used_and_its_tokens_are_refused(
    cluster: Cluster, workload: Workload
) -> None:
    """Split brain: the old primary runs on, writable, but clients cannot reach it. Nothing
    of ours writes there after the cut, and a token it issues is refused on the new
    primary once a newer holder wrote."""
    w = workload
    w.beat("leader")
    w.settle(w.send(w.key("before"), slot=SLOT))
    cluster.replica.wait_replayed()

    promoted = cluster.fail_over(old_primary="cut off")
    cut_at = server_now(cluster.primary.dsn)
    w.beat_recovery("split brain -> first beat slot executed", promoted)
    [after] = w.send(w.key("after"), slot=SLOT)
    w.settle([after])
    with psycopg.connect(cluster.dsn) as conn, conn.transaction():
        fence(conn, "split", int(after.result.result), tables=tables(w))
    checked(w)
    assert 0 == writes_since(cluster.primary.dsn, w, cut_at)

    stale = token_on(cluster.primary.dsn, w, "split-brain-holder")
    with psycopg.connect(cluster.dsn) as conn, pytest.raises(StaleToken), conn.transaction():
        fence(conn, "split", stale, tables=tables(w))


def server_now(dsn: str) -> datetime:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def tables(w: Workload) -> Tables:
    return Tables(w.schema)


def token_on(dsn: str, w: Workload, name: str) -> int:
    """A fencing token taken on the server ``dsn`` names (the old primary, directly)."""
    db = Database(Settings(dsn=dsn, schema=w.schema))
    db.open()
    try:
        lease = acquire(db, Claim(name, lock_key(name), None, "t-x", "tests"), "session", None)
        assert isinstance(lease, Lease)
        release(db, lease, "succeeded")
        return int(lease.token)
    finally:
        db.close()
        close_all()


def writes_since(dsn: str, w: Workload, moment: datetime) -> int:
    """Ledger rows, holders and executions the old primary got after ``moment``."""
    query = sql.SQL(
        "SELECT (SELECT count(*) FROM {runs} WHERE updated_at > %(t)s)"
        " + (SELECT count(*) FROM {holders} WHERE since > %(t)s)"
        " + (SELECT count(*) FROM {executions} WHERE started > %(t)s)"
    ).format(
        runs=sql.Identifier(w.schema, "pglock_runs"),
        holders=sql.Identifier(w.schema, "pglock_holders"),
        executions=sql.Identifier(w.schema, "executions"),
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, {"t": moment}).fetchone()
    assert row is not None
    return int(row[0])


def test_successes_an_asynchronous_promotion_lost_are_written_back_or_reported(
    cluster: Cluster, workload: Workload
) -> None:
    """The replica stopped receiving WAL before two jobs succeeded on the primary; the
    promotion loses both successes. The worker that ran them writes the first back on its
    next connection (its duplicate then skips); the second had already run again on
    another worker: reported as an ERROR, the double run asynchronous replication allows."""
    w = workload
    [remembering] = w.workers
    other_queue = w.env["TEST_QUEUE"] + "-other"
    other = w.worker("other", concurrency=1, queue=other_queue)
    cluster.replica.wait_replayed()
    cluster.replica.stop_shipping()
    kept_key, again_key = w.key("kept"), w.key("again")
    [kept] = w.send(kept_key, slot=SLOT)
    [again] = w.send(again_key, slot=SLOT)
    w.settle([kept, again])
    cluster.fail_over()

    [rerun] = w.send(again_key, slot=SLOT, queue=other_queue)
    w.settle([rerun])
    w.settle(w.send(w.key("probe"), slot=SLOT, copies=3))  # every child reconnects
    [duplicate] = w.send(kept_key, slot=SLOT, queue=other_queue)
    w.settle([duplicate])

    states = (kept.result.state, rerun.result.state, duplicate.result.state)
    assert ("SUCCESS", "SUCCESS", "SKIPPED") == states
    rows = {r["lock_name"]: r for r in w.ledger()}
    assert ("succeeded", kept.result.result) == (rows[kept.lock]["state"], rows[kept.lock]["token"])
    assert "written back" in remembering.log_text()
    assert "ran again after the failover" in remembering.log_text()
    assert "ran again" not in other.log_text()
    w.stop()
    report = w.check()
    # The jobs' own writes went with the lost WAL, like their ledger rows: the checker
    # finds that their SUCCESS tokens never ran. Nothing else is amiss.
    lost = sorted(f"{sent.result.id}:" for sent in (kept, again))
    assert lost == sorted(line.split(" ", 1)[0] for line in report.succeeded_twice)
    assert ([], []) == (report.unresolved, report.unsettled)
