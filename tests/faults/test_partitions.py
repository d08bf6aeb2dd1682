"""Network partitions between the processes and PostgreSQL, through TCP proxies the test controls.

Worker A reaches PostgreSQL through a proxy, worker B directly; both beat replicas go
through proxies of their own. In one run: A's connections are cut (RST) while it holds a
lock, then blackholed (bytes stop, nothing is closed) past its lease, each time with a
duplicate of its slot sent to B; then the beat leader is cut off (a standby takes over at
once), and the new leader is blackholed (the other takes over after the lease). Leases
are short (2 s) so the run stays short.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from tests.faults.workload import HOSTNAME, MEASUREMENTS, Invariants, Run, Sent, Workload
from tests.fixtures.procs import Proc, Procs, wait_until
from tests.fixtures.proxy import ProxyFactory, TcpProxy

# Run alone (serial): partitions timed against 2-s leases; recovery times measured alone, which
# other tests' load would distort.
pytestmark = [pytest.mark.faults, pytest.mark.serial]

SLOT = "2026-11-29T18:05:00Z"
LEASE = 2.0  # seconds: task and beat lease
DEADLINE = 30.0


def backend_gone(dsn: str, backend_pid: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = "SELECT 1 FROM pg_stat_activity WHERE pid = %s"
        return conn.execute(query, (backend_pid,)).fetchone() is None


def holder_backend(w: Workload, sent: Sent) -> int:
    [run] = [r for r in w.ledger() if r["lock_name"] == sent.lock]
    return int(run["backend_pid"])


def partition_worker(
    w: Workload, proxy: TcpProxy, queue_a: str, how: str, facts: dict[str, Any]
) -> None:
    """Partition worker A while it holds a lock; B runs the duplicate; A must not count."""
    gate, key = w.gate(), w.key(how)
    [held] = w.send(key, slot=SLOT, gate=str(gate), queue=queue_a)
    w.running(key)
    backend = holder_backend(w, held)
    started = time.monotonic()
    if how == "cut":
        proxy.cut()
    else:
        proxy.blackhole()
    wait_until(
        lambda: backend_gone(w.admin_dsn, backend),
        timeout=DEADLINE,
        message="the server to end the partitioned holder's session",
    )
    MEASUREMENTS[f"{w.name}: worker {how} -> holder's lock freed"] = round(
        time.monotonic() - started, 3
    )
    [duplicate] = w.send(key, slot=SLOT)
    w.settle([duplicate])
    proxy.restore()
    restored = time.monotonic()
    gate.touch()
    w.settle([held])
    facts[how] = (held, duplicate)
    [probe] = w.send(w.key("probe"), slot="probe", queue=queue_a)
    w.settle([probe])
    MEASUREMENTS[f"{w.name}: worker {how} restored -> its next job succeeds"] = round(
        time.monotonic() - restored, 3
    )
    facts[f"{how}-probe"] = probe


def partition_leader(w: Workload, leader: Proc, proxy: TcpProxy, standby: Proc, how: str) -> None:
    """Cut or blackhole the leading beat; the standby takes over; the old one sends nothing."""
    at = time.time()
    started = time.monotonic()
    if how == "cut":
        proxy.cut()
    else:
        proxy.blackhole()
    w.wait_for(
        lambda: w.leader_since(standby, at),
        timeout=DEADLINE,
        message=f"the standby to lead after the leader was {how}",
    )
    elected = w.leader_since(standby, at)
    assert elected is not None
    MEASUREMENTS[f"{w.name}: beat leader {how} -> standby leads"] = round(elected - at, 3)
    w.beat_recovery(f"beat leader {how} -> next slot executed", started)
    proxy.restore()
    w.wait_for(
        lambda: w.standing_by(leader),
        timeout=DEADLINE,
        message=f"the old leader to stand by after the {how}",
    )


def sends_by(w: Workload, proc: Proc, after: float, before: float = float("inf")) -> list[str]:
    """Slots the beat ``proc`` claimed between ``after`` and ``before`` (epoch seconds)."""
    replica = f"{HOSTNAME}:{proc.pid}"
    return [
        s["slot"]
        for s in w.beat_sends()
        if s["sent_by"] == replica and after < s["claimed_at"].timestamp() < before
    ]


@pytest.fixture(scope="module")
def run(pg_dsn: str, redis_url: str, run_procs: Procs) -> Iterator[Run]:
    """The whole run: worker and beat partitions in turn, then the checker."""
    proxies = ProxyFactory()
    w = Workload(
        name="partition",
        admin_dsn=pg_dsn,
        app_dsn=pg_dsn,
        redis_url=redis_url,
        procs=run_procs,
        TEST_LEASE=LEASE,
        TEST_BEAT_LEASE=LEASE,
    )
    result = Run(w)
    try:
        w.prepare()
        to_a, to_b1, to_b2 = (proxies.for_dsn(pg_dsn) for _ in range(3))
        queue_a = w.env["TEST_QUEUE"] + "-a"
        w.worker("a", queue=queue_a, PGLOCK_DSN=to_a.proxied_dsn(pg_dsn))
        w.worker("b")
        beat_1 = w.beat("1", PGLOCK_DSN=to_b1.proxied_dsn(pg_dsn))
        beat_2 = w.beat("2", lead=False, PGLOCK_DSN=to_b2.proxied_dsn(pg_dsn))
        partition_worker(w, to_a, queue_a, "cut", result.facts)
        partition_worker(w, to_a, queue_a, "blackhole", result.facts)
        cut_at = time.time()
        partition_leader(w, beat_1, to_b1, beat_2, "cut")
        blackholed_at = time.time()
        partition_leader(w, beat_2, to_b2, beat_1, "blackhole")
        result.facts["beat"] = (beat_1, cut_at, beat_2, blackholed_at)
        w.stop()
        result.report = w.check()
        yield result
    finally:
        proxies.stop_all()
        w.drop()


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""

    min_slots = 6


@pytest.mark.parametrize("how", ["cut", "blackhole"])
def test_partitioned_holder_is_superseded_and_cannot_record_success(run: Run, how: str) -> None:
    """A holder cut off from PostgreSQL loses its lock; the duplicate's run is the one."""
    held, duplicate = run.facts[how]
    [ledger_row] = [r for r in run.workload.ledger() if r["lock_name"] == held.lock]
    assert ("FAILURE", "LockLost") == (held.result.state, type(held.result.result).__name__)
    assert ("succeeded", duplicate.result.result) == (ledger_row["state"], ledger_row["token"])


@pytest.mark.parametrize("how", ["cut", "blackhole"])
def test_partitioned_worker_serves_again_once_restored(run: Run, how: str) -> None:
    """After the partition heals, the same worker processes run jobs again."""
    assert "SUCCESS" == run.facts[f"{how}-probe"].result.state


def test_cut_off_beat_leader_sends_nothing_after_the_cut(run: Run) -> None:
    """The leader whose connection was cut claims no slot afterwards while the other leads."""
    beat_1, cut_at, _, blackholed_at = run.facts["beat"]
    assert [] == sends_by(run.workload, beat_1, cut_at, blackholed_at)


def test_blackholed_beat_leader_sends_nothing_after_the_partition(run: Run) -> None:
    """The leader blackholed past its lease never claims a slot again in this run."""
    _, _, beat_2, blackholed_at = run.facts["beat"]
    assert [] == sends_by(run.workload, beat_2, blackholed_at)
