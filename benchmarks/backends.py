"""The two lock backends side by side: ``python -m benchmarks.backends``.

Same server, same workload, one run: advisory locks on a direct connection, locks on rows
on a direct connection (``pglock_lock_backend = "rows"``), and locks on rows through
PgBouncer in transaction pooling (where ``"auto"`` picks them). Measured:

- *per claim*: a session-scope claim with a slot and its release (``acquire`` then
  ``release``, what a locked task adds to its body), in-process, rounds interleaved;
  and one heartbeat (an advisory lock's ping, a row's renewal);
- *beat failover*: three ``celery beat`` replicas (``benchmarks.beat_app``); the leader is
  SIGKILLed at a random phase of the second; seconds from the kill to a new leader's
  first claim (``benchmarks.beat_failover``);
- *connections at rest*: the connections those three replicas hold open once a leader
  sends, counted from their sockets (advisory: the leader's own session and each
  standby's, waiting in the lock queue, besides their pools; on rows: their pools only).

PgBouncer: the Debian package's binary, started on a loopback port for the run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from psycopg.conninfo import conninfo_to_dict

from benchmarks import common
from benchmarks.beat_failover import REPLICAS, Cluster, sleep_until
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store._database import Database
from tests.faults.pgbouncer import PgBouncer

BACKENDS = ("advisory", "rows", "rows via PgBouncer")
ROUNDS = 8
PER_ROUND = 200
TRIALS = 6  # beat failovers per backend
BEAT_LEASE = 5.0
LEASE = 30.0


@dataclass
class Result:
    claim: dict[str, list[float]] = field(default_factory=dict)  # seconds per claim+release
    ping: dict[str, list[float]] = field(default_factory=dict)  # seconds per heartbeat
    failover: dict[str, list[float]] = field(default_factory=dict)  # kill -> new claim
    at_rest: dict[str, int] = field(default_factory=dict)  # server sessions of 3 replicas
    load: common.LoadWindow = field(default_factory=common.LoadWindow)


@contextlib.contextmanager
def databases(dsn: str, bouncer: PgBouncer, schema: str) -> Iterator[dict[str, Database]]:
    """A ``Database`` per backend, on one schema."""
    settings = {
        "advisory": Settings(dsn=dsn, schema=schema, lock_backend="advisory"),
        "rows": Settings(dsn=dsn, schema=schema, lock_backend="rows"),
        "rows via PgBouncer": Settings(dsn=bouncer.dsn_for("tx"), schema=schema),
    }
    found = {name: Database(value) for name, value in settings.items()}
    try:
        for db in found.values():
            db.open()
        assert found["rows via PgBouncer"].on_rows, "PgBouncer's pooler was not detected"
        yield found
    finally:
        for db in found.values():
            db.close()


def claim(name: str, slot: str) -> Claim:
    return Claim(name, lock_key(name), slot, uuid.uuid4().hex, "bench.task")


def granted(outcome: Any) -> Lease:
    assert isinstance(outcome, Lease), outcome
    return outcome


def claims_round(db: Database, name: str, count: int) -> tuple[float, float]:
    """``count`` claims and releases of fresh slots, then ``count`` heartbeats of one
    held lock: (seconds per claim+release, seconds per heartbeat)."""
    started = time.perf_counter()
    for _ in range(count):
        lease = granted(acquire(db, claim(name, uuid.uuid4().hex), "session", LEASE))
        release(db, lease, SUCCEEDED)
    per_claim = (time.perf_counter() - started) / count
    lease = granted(acquire(db, claim(name, uuid.uuid4().hex), "session", LEASE))
    started = time.perf_counter()
    for _ in range(count):
        lease.lock_session.ping()
    per_ping = (time.perf_counter() - started) / count
    release(db, lease, SUCCEEDED)
    return per_claim, per_ping


def measure_claims(
    result: Result, dbs: dict[str, Database], schema: str, rounds: int, count: int
) -> None:
    for name in BACKENDS:
        result.claim[name], result.ping[name] = [], []
        claims_round(dbs[name], f"{schema}:warm-{name}", 20)  # connections, plans
    for i in range(rounds):
        for name in common.rotate_list(BACKENDS, i):
            per_claim, per_ping = claims_round(dbs[name], f"{schema}:{name}", count)
            result.claim[name].append(per_claim)
            result.ping[name].append(per_ping)


class BeatReplicas(Cluster):
    """``beat_failover.Cluster`` for either backend: ready once each replica competes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.conn.prepare_threshold = None  # its look-ups may go through PgBouncer

    def ready(self) -> None:
        alive = [p for p in self.replicas.values() if p.poll() is None]
        common.wait_for(lambda: len(self._competing()) >= len(alive), 30, "every replica up")
        common.wait_for(self.recent_claim, 30, "a leader sending")

    def _competing(self) -> list[Path]:
        return [
            log
            for log in self.logs.glob("beat-*.log")
            if "beat leader election on" in log.read_text(errors="replace")
        ]


def failover_trials(
    cluster: BeatReplicas, trials: int, rng: random.Random
) -> tuple[list[float], int]:
    """Seconds from a leader's SIGKILL to a new leader's first claim, per trial, and the
    server sessions of the replicas at rest before the first kill."""
    cluster.ready()
    time.sleep(2.0)  # at rest: every replica competing, the leader sending
    at_rest = sessions_of(cluster)
    seconds = []
    for _ in range(trials):
        cluster.ready()
        old = cluster.claims()[-1].pid
        sleep_until(int(time.time()) + 1 + rng.random())
        at = time.time()
        cluster.replicas[old].send_signal(signal.SIGKILL)
        seconds.append(new_leader_claim(cluster, old, at) - at)
        cluster.replicas[old].wait()
        cluster.start()
    return seconds, at_rest


def new_leader_claim(cluster: BeatReplicas, old: int, after: float) -> float:
    """When a replica other than ``old`` first claimed after ``after`` (epoch)."""
    found = common.wait_for(lambda: cluster.first_claim_by_other(old, after), 60, "a new leader")
    return found.claimed_at


def sessions_of(cluster: BeatReplicas) -> int:
    """Connections the replicas hold open to the DSN's port (PostgreSQL's, or PgBouncer's),
    counted from their sockets: the same count for both backends."""
    port = int(str(conninfo_to_dict(cluster.dsn).get("port") or 5432))
    pids = [p.pid for p in cluster.replicas.values() if p.poll() is None]
    return sum(len(connections_to(pid, port)) for pid in pids)


def connections_to(pid: int, port: int) -> set[str]:
    """Socket inodes of ``pid``'s established TCP connections to ``port`` on loopback."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            remote, state, inode = fields[2], fields[3], fields[9]
            if state == "01" and int(remote.rsplit(":", 1)[1], 16) == port and inode in inodes:
                found.add(inode)
    return found


def measure_failover(
    result: Result, dsn: str, bouncer: PgBouncer, broker: str, *, trials: int, seed: int
) -> None:
    rng = random.Random(seed)
    for name, app_dsn in (("advisory", dsn), ("rows via PgBouncer", bouncer.dsn_for("tx"))):
        with (
            common.private_schema(dsn, "backends") as schema,
            tempfile.TemporaryDirectory() as logs,
        ):
            cluster = BeatReplicas(app_dsn, broker, schema, BEAT_LEASE, Path(logs))
            try:
                for _ in range(REPLICAS):
                    cluster.start()
                result.failover[name], result.at_rest[name] = failover_trials(cluster, trials, rng)
            finally:
                cluster.close()


def run(
    dsn: str,
    broker: str,
    *,
    seed: int,
    rounds: int = ROUNDS,
    count: int = PER_ROUND,
    trials: int = TRIALS,
) -> Result:
    result = Result()
    with tempfile.TemporaryDirectory() as tmp:
        bouncer = PgBouncer(dsn, Path(tmp) / "pgbouncer.log")
        try:
            with (
                common.private_schema(dsn, "backends") as schema,
                databases(dsn, bouncer, schema) as dbs,
            ):
                measure_claims(result, dbs, schema, rounds, count)
            measure_failover(result, dsn, bouncer, broker, trials=trials, seed=seed)
        finally:
            bouncer.stop()
    result.load.close()
    return result


def section(result: Result) -> tuple[list[str], list[common.Target]]:
    advisory = common.Summary.of(result.claim["advisory"]).median
    rows = []
    for name in BACKENDS:
        per_claim = common.Summary.of(result.claim[name])
        per_ping = common.Summary.of(result.ping[name])
        rows.append(
            [
                name,
                f"{common.ms(per_claim.median)} ({common.ms(per_claim.low)}{common.DASH}"
                f"{common.ms(per_claim.high)})",
                common.ratio(per_claim.median / advisory),
                common.ms(per_ping.median),
            ]
        )
    failover = []
    for name, seconds in result.failover.items():
        failover.append(
            [
                name,
                str(len(seconds)),
                common.ms(common.Summary.of(seconds).median),
                common.ms(max(seconds)),
                str(result.at_rest[name]),
            ]
        )
    lines = [
        "Same server and workload, one run ("
        f'{result.load.text()}). *rows*: `pglock_lock_backend = "rows"` on a direct '
        'connection; *rows via PgBouncer*: `"auto"` behind PgBouncer in transaction '
        "pooling (the Debian package, on this machine).",
        "",
        "**Per claim** (a session-scope claim of a fresh slot and its release, in-process; "
        "median of the rounds' means, min\N{EN DASH}max over rounds) and **per heartbeat** "
        "(an advisory lock's ping; a row's renewal):",
        "",
        *common.table(["backend", "claim + release", "vs advisory", "heartbeat"], rows),
        "",
        f"**Beat failover** (three replicas, `pglock_beat_lease` = {BEAT_LEASE:g} s; the "
        "leader SIGKILLed at a random phase of the second; to a new leader's first claim) "
        "and **connections at rest** (connections the three replicas hold open while one "
        "leads, from their sockets: to PostgreSQL, or to PgBouncer):",
        "",
        *common.table(
            ["backend", "trials", "median", "max", "connections at rest (3 replicas)"], failover
        ),
        "",
        READING,
    ]
    worst = max(result.failover["rows via PgBouncer"])
    targets = [
        common.Target(
            "16. beat failover after SIGKILL behind a transaction pooler, max",
            f"\N{LESS-THAN OR EQUAL TO} lease + 1 s = {BEAT_LEASE + 1:g} s",
            f"{worst:.2f} s",
            worst <= BEAT_LEASE + 1,
        )
    ]
    return lines, targets


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.backends")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--per-round", type=int, default=PER_ROUND)
    parser.add_argument("--trials", type=int, default=TRIALS)
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args(argv)
    broker = common.empty_broker(common.redis_base())
    with common.postgres() as dsn:
        sizes = {"rounds": args.rounds, "count": args.per_round, "trials": args.trials}
        result = run(dsn, broker, **sizes, seed=args.seed)
    lines, targets = section(result)
    print("\n".join(lines))
    if args.write:
        docs = common.ROOT / "docs" / "benchmarks.md"
        common.write_section(docs, TITLE, lines, "| 16. ", targets)


TITLE = "16. Lock backends side by side: advisory locks and rows"
READING = (
    "Reading: a claim on rows writes one more row (the lock's) in the claim's statement "
    "and deletes it in the release's; a renewal is a write where an advisory ping is a "
    "`SELECT 1`. A killed leader's row lives until its lease runs out: the failover is "
    "the lease less the time since its last renewal (up to a third of it), plus a "
    "standby's poll (at most 0.5 s) and the wait for the next slot's second; on an "
    "advisory lock it is that wait alone. Either way each replica keeps one connection "
    "at rest (advisory: the leader's session or a standby's, waiting in the lock queue; "
    "on rows: its pool's one, to PgBouncer)."
)

if __name__ == "__main__":
    main()
