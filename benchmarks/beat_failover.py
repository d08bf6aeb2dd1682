"""Beat failover time: ``python -m benchmarks.beat_failover``.

Three ``celery beat`` replicas (leader election on) send one entry every second. A
trial SIGKILLs, or SIGSTOPs for twice the lease, the replica that leads, at a random
phase of the second, and reads from ``beat_sends`` the first claim a new leader makes.
Per trial:

- *lateness*: ``claimed_at - slot`` of that first claim (how late the new leader sent
  the slot it sent first);
- *gap*: ``claimed_at`` of that claim minus the due time of the first slot the old
  leader did not send (how long nobody sent anything that was due);
- *missed*: slots between the old leader's last and the new leader's first.

The cost of one tick with many due entries: ``python -m benchmarks.tick``.

PostgreSQL: ``PGLOCK_DSN`` if set, else a private embedded server. Redis:
``PGLOCK_TEST_REDIS_URL`` or ``redis://127.0.0.1:6379/0``. The results are printed and
written to ``docs/benchmarks-beat.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import psycopg
import redis
from psycopg import sql

from benchmarks import common
from celery_pglock._keys import lock_key

ROOT = Path(__file__).resolve().parent.parent
REPORT = ROOT / "docs" / "benchmarks-beat.md"
SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
REPLICAS = 3


# -- infrastructure ----------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    slot: str
    pid: int
    claimed_at: float

    @property
    def due(self) -> float:
        return slot_epoch(self.slot)


def slot_epoch(slot: str) -> float:
    return datetime.strptime(slot, SLOT_FORMAT).replace(tzinfo=timezone.utc).timestamp()


def sleep_until(epoch: float) -> None:
    time.sleep(max(0.0, epoch - time.time()))


def stopped(pid: int) -> bool:
    """Whether SIGSTOP has taken effect (state T in /proc)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@dataclass
class Cluster:
    """Beat replicas of ``benchmarks.beat_app`` sharing one schema, queue and namespace."""

    dsn: str
    broker: str
    schema: str
    lease: float
    logs: Path
    namespace: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")
    queue: str = field(default_factory=lambda: f"bench-{uuid.uuid4().hex[:8]}")
    replicas: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.conn = psycopg.connect(self.dsn, autocommit=True)
        self.leader_key = lock_key(f"{self.namespace}:beat-leader")

    def start(self) -> int:
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "PGLOCK_DSN": self.dsn,
            "BENCH_BROKER_URL": self.broker,
            "BENCH_SCHEMA": self.schema,
            "BENCH_NAMESPACE": self.namespace,
            "BENCH_QUEUE": self.queue,
            "BENCH_LEASE": str(self.lease),
        }
        argv = [sys.executable, "-m", "celery", "-A", "benchmarks.beat_app", "beat", "-l", "INFO"]
        log = (self.logs / f"beat-{len(self.replicas)}.log").open("ab")
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        self.replicas[proc.pid] = proc
        return proc.pid

    def claims(self) -> list[Claim]:
        query = sql.SQL(
            "SELECT slot, sent_by, extract(epoch FROM claimed_at) FROM {} "
            "WHERE namespace = %s ORDER BY claimed_at"
        ).format(sql.Identifier(self.schema, "pglock_beat_sends"))
        rows = self.conn.execute(query, (self.namespace,)).fetchall()
        return [Claim(slot, int(by.rsplit(":", 1)[1]), float(at)) for slot, by, at in rows]

    def waiting(self) -> int:
        """Standbys blocked on the leader lock."""
        query = (
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
            "AND classid::bigint = %s AND objid::bigint = %s"
        )
        key = self.leader_key & 0xFFFFFFFFFFFFFFFF
        row = self.conn.execute(query, (key >> 32, key & 0xFFFFFFFF)).fetchone()
        return int(row[0]) if row else 0

    def ready(self) -> None:
        """Wait for one leader sending and every other live replica standing by."""
        alive = sum(1 for proc in self.replicas.values() if proc.poll() is None)
        common.wait_for(lambda: self.waiting() >= alive - 1, 30, f"{alive - 1} standbys")
        common.wait_for(self.recent_claim, 30, "a leader sending")

    def recent_claim(self) -> Claim | None:
        claims = self.claims()
        return claims[-1] if claims and claims[-1].claimed_at > time.time() - 2 else None

    def first_claim_by_other(self, pid: int, after: float) -> Claim | None:
        return next((c for c in self.claims() if c.pid != pid and c.claimed_at > after), None)

    def close(self) -> None:
        for proc in self.replicas.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.replicas.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.conn.close()
        redis.Redis.from_url(self.broker).delete(self.queue)


# -- failover ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Trial:
    lateness: float
    gap: float
    missed: int
    detected: float  # first new claim - fault
    woken_claims: int = 0


def fault_trial(cluster: Cluster, fault: str, phase: float) -> Trial:
    """One SIGKILL or SIGSTOP of the leader, ``phase`` seconds into a second."""
    cluster.ready()
    old = cluster.claims()[-1].pid
    sleep_until(int(time.time()) + 1 + phase)
    at = time.time()
    proc = cluster.replicas[old]
    proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    if fault == "freeze":
        common.wait_for(lambda: stopped(old), 5, "the leader to stop")
    frozen_at = time.time()  # a claim made between `at` and here predates the freeze
    found = common.wait_for(
        lambda: cluster.first_claim_by_other(old, at), 30, "a new leader's claim"
    )
    assert found is not None
    first = found
    woken = 0
    if fault == "kill":
        proc.wait()
        cluster.start()  # keep three replicas
    else:
        sleep_until(at + 2 * cluster.lease)
        proc.send_signal(signal.SIGCONT)
        time.sleep(1.5)  # let it wake, find its session gone and step down
        woken = sum(1 for c in cluster.claims() if c.pid == old and c.claimed_at > frozen_at)
    last_old = max(c.due for c in cluster.claims() if c.pid == old)
    return Trial(
        lateness=first.claimed_at - first.due,
        gap=first.claimed_at - (last_old + 1),
        missed=int(first.due - last_old - 1),
        detected=first.claimed_at - at,
        woken_claims=woken,
    )


def run_failover(
    dsn: str, broker: str, fault: str, *, trials: int, lease: float, seed: int
) -> list[Trial]:
    rng = random.Random(seed)
    phases = [(i + rng.random()) / trials for i in range(trials)]
    rng.shuffle(phases)
    with common.private_schema(dsn, "beat") as schema, tempfile.TemporaryDirectory() as logs:
        cluster = Cluster(dsn, broker, schema, lease, Path(logs))
        try:
            for _ in range(REPLICAS):
                cluster.start()
            results = []
            for n, phase in enumerate(phases, 1):
                results.append(fault_trial(cluster, fault, phase))
                print(f"  {fault} trial {n}/{trials}: {results[-1]}", flush=True)
            return results
        finally:
            cluster.close()


# -- report ------------------------------------------------------------------------------

NOTES = """\
## Reading the numbers

- SIGKILL: PostgreSQL frees the leader lock the moment the session ends, and a
  standby's blocking `pg_advisory_lock` returns at once. What remains is the standby
  noticing (it polls its election every 0.2 s, `STANDBY_POLL`) and one tick. A slot
  that fell due in between is sent late by the new leader, not lost.
- SIGSTOP: `idle_session_timeout` ends the frozen leader's session between two thirds
  of the lease and the lease after the freeze (the heartbeat pings every third of the
  lease). Slots that fell due while nobody led are coalesced, as stock Celery coalesces
  missed runs: the new leader sends the latest one at once; with a 1-s entry and a 2-s
  lease that is one slot missed per freeze. The woken leader claims nothing.
- The cost of one tick with many due entries is measured by `python -m benchmarks.tick`
  (docs/benchmarks.md, section 3).
"""


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20, method="inclusive")[18]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f} ms" if seconds >= 0.0995 else f"{seconds * 1000:.1f} ms"


def failover_rows(fault: str, trials: list[Trial]) -> list[str]:
    rows = []
    for label, values in (
        ("lateness (claimed_at - slot)", [t.lateness for t in trials]),
        ("gap (first unsent slot due -> claim)", [t.gap for t in trials]),
        ("fault -> first new claim", [t.detected for t in trials]),
    ):
        cells = (ms(statistics.median(values)), ms(p95(values)), ms(max(values)))
        rows.append(f"| {fault} | {label} | {' | '.join(cells)} |")
    missed = sum(t.missed for t in trials)
    woken = sum(t.woken_claims for t in trials)
    rows.append(f"| {fault} | slots missed / claims by the woken leader | {missed} / {woken} | | |")
    return rows


def environment() -> str:
    with contextlib.suppress(OSError):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    return (
        f"{platform.python_implementation()} {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, load average at the end {load}, "
        f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    )


def report(args: argparse.Namespace, kill: list[Trial], freeze: list[Trial]) -> str:
    lines = [
        "# Beat benchmarks",
        "",
        "Measured by `python -m benchmarks.beat_failover` "
        f"({environment()}; PostgreSQL and Redis on the same host).",
        "",
        f"## Failover ({REPLICAS} replicas, one entry every 1 s, "
        f"`pglock_beat_lease = {args.lease:g}`, {args.trials} trials per fault)",
        "",
        "The leader is SIGKILLed, or SIGSTOPped for twice the lease, at a random phase of",
        "the second. *lateness* is `claimed_at - slot` of the first slot the new leader",
        "claims; *gap* runs from the due time of the first slot the old leader did not send",
        "to that claim. Times are server clock (`beat_sends.claimed_at`).",
        "",
        "| fault | measure | median | p95 | max |",
        "|---|---|---|---|---|",
        *failover_rows("SIGKILL", kill),
        *failover_rows("SIGSTOP", freeze),
        "",
        NOTES,
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--trials", type=int, default=12, help="trials per fault (>= 10)")
    parser.add_argument("--lease", type=float, default=2.0, help="pglock_beat_lease, seconds")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    broker = os.environ.get("PGLOCK_TEST_REDIS_URL", "").strip() or "redis://127.0.0.1:6379/0"
    with common.postgres() as dsn:
        print("failover after SIGKILL", flush=True)
        options = {"trials": args.trials, "lease": args.lease, "seed": args.seed}
        kill = run_failover(dsn, broker, "kill", **options)
        print("failover after SIGSTOP", flush=True)
        freeze = run_failover(dsn, broker, "freeze", **options)
    text = report(args, kill, freeze)
    print(text)
    if not args.no_write:
        REPORT.write_text(text)
        print(f"written to {REPORT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
