"""Beat failover side by side: celery-pglock (``benchmarks.beat_failover``) and celery-redbeat.

Three ``celery beat`` replicas send one entry every second; a trial SIGKILLs the replica
that sends, or SIGSTOPs it for twice its lease, at a random phase of the second. Common
measures: *fault → first send by another replica*, *gap* (that send minus one period
after the old leader's last send: how long the schedule went unserved beyond normal),
periods missed, and sends by the frozen leader after it woke (duplicates).

celery-pglock is measured by ``beat_failover.run_failover`` (sends read from its
``beat_sends`` table). For redbeat a watcher pops the messages off the queue and reads the
sender's pid from the ``origin`` header. redbeat with its defaults holds a 1,500 s lock
that standbys poll every 300 s: waiting for that failover ten times would take hours, so
those trials record the lock's remaining TTL at the kill and watch ``observe`` seconds.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import redis

from benchmarks import beat_failover, common

EVERY = 1.0
REPLICAS = 3


@dataclass(frozen=True)
class Trial:
    detected: float  # fault -> first send by another replica
    gap: float  # that send - (old leader's last send + one period)
    missed: int
    duplicates: int  # sends by the frozen leader after it woke


@dataclass
class Series:
    system: str
    config: str
    fault: str
    trials: list[Trial] = field(default_factory=list)
    note: str = ""
    lock_ttl: list[float] = field(default_factory=list)  # redbeat defaults: TTL at the kill


def from_pglock(trials: list[beat_failover.Trial]) -> list[Trial]:
    return [Trial(t.detected, t.gap, t.missed, t.woken_claims) for t in trials]


class Watcher:
    """Pops every message beat sends; remembers (time, sender pid)."""

    def __init__(self, url: str, queue: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.queue = queue
        self.sends: list[tuple[float, int]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-watcher", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            popped = self.client.brpop([self.queue], timeout=1)
            if popped:
                message = json.loads(popped[1])
                origin = message["headers"].get("origin", "gen0@")
                self.sends.append((time.time(), int(origin[3:].split("@")[0])))

    def last(self) -> tuple[float, int] | None:
        return self.sends[-1] if self.sends else None

    def first_by_other(self, pid: int, after: float) -> tuple[float, int] | None:
        return next(((t, p) for t, p in self.sends if p != pid and t > after), None)

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(3)
        self.client.close()


class RedbeatCluster:
    def __init__(self, env: dict[str, str], logs: Path, max_loop: float | None) -> None:
        tag = uuid.uuid4().hex[:6]
        self.queue = f"{env['BENCH_PREFIX']}-rb-{tag}"
        self.env = {
            **env,
            "BENCH_QUEUE": self.queue,
            "BENCH_PREFIX": f"{env['BENCH_PREFIX']}-{tag}",
            "BENCH_EVERY": str(EVERY),
            "BENCH_MAX_LOOP": "" if max_loop is None else str(max_loop),
        }
        self.lock_key = f"{self.env['BENCH_PREFIX']}-redbeat::lock"
        self.logs = logs
        self.replicas: dict[int, subprocess.Popen[bytes]] = {}
        self.watcher = Watcher(env["BENCH_BROKER_URL"], self.queue)
        self.client = redis.Redis.from_url(env["BENCH_BROKER_URL"])

    def start(self) -> int:
        argv = common.celery("-A", "benchmarks.redbeat_app", "beat", "-l", "INFO")
        log = self.logs / f"redbeat-{len(self.replicas)}-{uuid.uuid4().hex[:4]}.log"
        proc = common.start_process(argv, log, self.env)
        self.replicas[proc.pid] = proc
        return proc.pid

    def ready(self) -> int:
        """Wait for a replica sending; returns its pid."""

        def recent() -> tuple[float, int] | None:
            last = self.watcher.last()
            return last if last is not None and last[0] > time.time() - 1.5 else None

        return common.wait_for(recent, 60, "redbeat sending")[1]

    def lock_ttl(self) -> float:
        return max(0.0, float(self.client.pttl(self.lock_key)) / 1000)

    def close(self) -> None:
        for proc in self.replicas.values():
            common.stop_process(proc)
        self.watcher.close()
        self.client.delete(self.queue, f"_kombu.binding.{self.queue}")
        for key in self.client.scan_iter(match=f"{self.env['BENCH_PREFIX']}-redbeat:*"):
            self.client.delete(key)
        self.client.close()


def redbeat_trial(cluster: RedbeatCluster, fault: str, phase: float, lease: float) -> Trial:
    leader = cluster.ready()
    beat_failover.sleep_until(int(time.time()) + 1 + phase)
    at = time.time()
    proc = cluster.replicas[leader]
    proc.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    found: tuple[float, int] = common.wait_for(
        lambda: cluster.watcher.first_by_other(leader, at), 60, "a new sender"
    )
    duplicates = 0
    if fault == "kill":
        proc.wait()
    else:
        beat_failover.sleep_until(at + 2 * lease)
        proc.send_signal(signal.SIGCONT)
        time.sleep(2.0)
        duplicates = sum(1 for t, p in cluster.watcher.sends if p == leader and t > at)
    if proc.poll() is not None or fault == "kill":
        common.stop_process(proc)
        cluster.replicas.pop(leader)
        cluster.start()  # keep three replicas
    last_old = max(t for t, p in cluster.watcher.sends if p == leader and t <= at)
    return Trial(
        detected=found[0] - at,
        gap=found[0] - (last_old + EVERY),
        missed=max(0, round((found[0] - last_old) / EVERY) - 1),
        duplicates=duplicates,
    )


def run_redbeat(env: dict[str, str], fault: str, trials: int, seed: int) -> Series:
    """redbeat with ``beat_max_loop_interval = 1`` (lock 5 s)."""
    rng = random.Random(seed)
    series = Series("celery-redbeat", "beat_max_loop_interval = 1 (lock 5 s)", fault)
    with tempfile.TemporaryDirectory(prefix="pglockbench-rb-") as logs:
        cluster = RedbeatCluster(env, Path(logs), max_loop=1.0)
        try:
            for _ in range(REPLICAS):
                cluster.start()
            for number in range(trials):
                series.trials.append(redbeat_trial(cluster, fault, rng.random(), 5.0))
                print(f"  redbeat {fault} trial {number + 1}/{trials}: {series.trials[-1]}")
        finally:
            cluster.close()
    return series


def run_redbeat_defaults(env: dict[str, str], trials: int, observe: float) -> Series:
    """redbeat with every default: kill the sender, record the lock TTL, watch ``observe`` s."""
    series = Series("celery-redbeat", "defaults (lock 1,500 s)", "kill")
    for number in range(trials):
        with tempfile.TemporaryDirectory(prefix="pglockbench-rb-") as logs:
            cluster = RedbeatCluster(env, Path(logs), max_loop=None)
            try:
                for _ in range(REPLICAS):
                    cluster.start()
                leader = cluster.ready()
                time.sleep(2.0)  # the standbys are blocked in the lock by now
                at = time.time()
                cluster.replicas[leader].send_signal(signal.SIGKILL)
                series.lock_ttl.append(cluster.lock_ttl())
                time.sleep(observe)
                taken = cluster.watcher.first_by_other(leader, at)
                print(
                    f"  redbeat defaults kill {number + 1}/{trials}: lock TTL "
                    f"{series.lock_ttl[-1]:,.0f} s, new sender within {observe:g} s: {bool(taken)}"
                )
                if taken:
                    series.trials.append(Trial(taken[0] - at, taken[0] - at - EVERY, 0, 0))
            finally:
                cluster.close()
    series.note = (
        f"no other replica sent within {observe:g} s of the kill" if not series.trials else ""
    )
    return series


def run_pglock(
    dsn: str, broker: str, fault: str, *, trials: int, lease: float, seed: int
) -> Series:
    found = beat_failover.run_failover(dsn, broker, fault, trials=trials, lease=lease, seed=seed)
    return Series("celery-pglock", f"pglock_beat_lease = {lease:g} s", fault, from_pglock(found))


def run(
    env: dict[str, str], dsn: str, *, trials: int, lease: float, default_trials: int, observe: float
) -> tuple[list[Series], common.LoadWindow]:
    load = common.LoadWindow()
    broker = env["BENCH_BROKER_URL"]
    series = []
    for fault in ("kill", "freeze"):
        series.append(run_pglock(dsn, broker, fault, trials=trials, lease=lease, seed=1))
        series.append(run_redbeat(env, fault, trials, seed=1))
    if default_trials:
        series.append(run_redbeat_defaults(env, default_trials, observe))
    load.close()
    return series, load
