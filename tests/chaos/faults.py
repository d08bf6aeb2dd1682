"""The fault catalogue: what the campaign injects, drawn up front from the seed.

``draw_schedule(seed, seconds)`` is pure: the same seed gives the same list of faults
(times, kinds and every choice a fault makes), whatever the machine does meanwhile. Each
``Fault`` carries ``pick`` (which of the candidate targets it takes, as a fraction, since
the candidates are only known when it fires), ``leader`` (a beat kill takes the leader, a
terminated backend is a lock holder's: half the time) and ``length`` (how long a freeze or
a blackhole lasts beyond the lease, or how long a killed process stays down).

``inject(fault, cluster)`` applies one fault to the running system (``campaign.Cluster``)
and returns what it hit and what to undo later (a restart, a SIGCONT, a restored proxy):
the undo runs from the campaign's loop at its time, so faults overlap as they would in
production instead of queueing behind one another.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from tests.chaos.campaign import Cluster

KINDS = (
    "beat_kill",  # SIGKILL a beat replica (the leader half the time), restart it later
    "child_kill",  # SIGKILL a worker's pool process while it runs a task
    "worker_kill",  # SIGKILL a whole worker (main process and pool), restart it later
    "freeze",  # SIGSTOP a pool process running a task for longer than its lease, SIGCONT
    "terminate_backend",  # pg_terminate_backend of a library session (a holder's half the time)
    "pg_restart_fast",  # pg_ctl restart -m fast
    "pg_restart_immediate",  # pg_ctl restart -m immediate (a crash: recovery at start)
    "proxy_cut",  # reset every connection between the proxied worker and PostgreSQL
    "proxy_blackhole",  # stop every byte between them, longer than a lease; then restore
    "pgbouncer_restart",  # restart the transaction-pooling PgBouncer in front of one worker
    "pg_failover",  # crash the primary, promote its synchronous replica; a new one later
)
MIN_GAP = 2.0  # seconds between two faults, drawn uniformly
MAX_GAP = 4.0
MIN_LENGTH = 1.0  # seconds, see Fault.length
MAX_LENGTH = 3.0
FIND_TARGET_FOR = 2.0  # seconds a fault waits for a task to be running before giving up


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; ``at`` is seconds after the start of the fault phase."""

    index: int
    at: float
    kind: str
    pick: float
    leader: bool
    length: float

    def choose(self, candidates: list[Any]) -> Any:
        """The candidate this fault takes (candidates in a stable order)."""
        return candidates[min(len(candidates) - 1, int(self.pick * len(candidates)))]


def draw_schedule(seed: int, seconds: float) -> list[Fault]:
    """Faults every 2-4 s for ``seconds``, every choice drawn from ``random.Random(seed)``."""
    rng = random.Random(seed)
    faults: list[Fault] = []
    at = rng.uniform(MIN_GAP, MAX_GAP)
    while at < seconds:
        # Always the same draws per fault, whatever its kind: the schedule of a seed never
        # depends on which kinds a machine can inject.
        kind = rng.choice(KINDS)
        pick, leader = rng.random(), rng.random() < 0.5
        length = rng.uniform(MIN_LENGTH, MAX_LENGTH)
        faults.append(Fault(len(faults), round(at, 3), kind, pick, leader, round(length, 3)))
        at += rng.uniform(MIN_GAP, MAX_GAP)
    return faults


@dataclass
class Undo:
    """Something to do ``after`` seconds from now: restart, thaw, restore."""

    after: float
    label: str
    action: Callable[[], None]


@dataclass
class Hit:
    """What a fault did: its target (None: nothing to hit), details, what to undo."""

    target: str | None
    detail: dict[str, Any] = field(default_factory=dict)
    undo: list[Undo] = field(default_factory=list)
    leader_lost: bool = False  # the beat leader lost its session (failover gap measured)
    lost_at: float | None = None  # when it did (epoch); None: when the fault began


def inject(fault: Fault, cluster: Cluster) -> Hit:
    """Apply ``fault`` to ``cluster``."""
    return INJECTORS[fault.kind](fault, cluster)


def beat_kill(fault: Fault, cluster: Cluster) -> Hit:
    beats = cluster.live_beats()
    if not beats:
        return Hit(None, {"why": "no beat replica alive"})
    leader = cluster.leader_pid()  # None in active-active mode: any replica
    leading = [item for item in beats if item[1].pid == leader]
    others = [item for item in beats if item[1].pid != leader]
    label, proc = fault.choose(leading if fault.leader and leading else others or beats)
    was_leader = proc.pid == leader
    cluster.kill(proc)
    restart = Undo(fault.length, f"restart beat {label}", lambda: cluster.start_beat(label))
    detail = {"pid": proc.pid, "leader": was_leader}
    killed_at = cluster.deaths[proc.pid]
    return Hit(f"beat {label}", detail, [restart], leader_lost=was_leader, lost_at=killed_at)


def child_kill(fault: Fault, cluster: Cluster) -> Hit:
    # A pool process: a threads worker's tasks run in the worker (that is worker_kill).
    whole = cluster.in_process_workers()
    running = [
        task for task in cluster.wait_for_running(FIND_TARGET_FOR) if task["pid"] not in whole
    ]
    if not running:
        return Hit(None, {"why": "no task running"})
    task = fault.choose(running)
    cluster.kill_pid(task["pid"])
    return Hit(f"pool process {task['pid']}", _task_detail(task))


def worker_kill(fault: Fault, cluster: Cluster) -> Hit:
    workers = cluster.live_workers()
    if not workers:
        return Hit(None, {"why": "no worker alive"})
    label, proc = fault.choose(workers)
    family = [proc.pid, *proc.descendants()]
    cluster.kill(proc)
    restart = Undo(fault.length, f"restart worker {label}", lambda: cluster.start_worker(label))
    return Hit(f"worker {label}", {"pids": family}, [restart])


def freeze(fault: Fault, cluster: Cluster) -> Hit:
    running = cluster.wait_for_running(FIND_TARGET_FOR)
    if not running:
        return Hit(None, {"why": "no task running"})
    # The long task (shortest lease) when one runs: its lease runs out soonest.
    longest = [task for task in running if task["task"] == "chaos.long"] or running
    task = fault.choose(longest)
    pid = task["pid"]
    seconds = cluster.lease_of(task["task"]) + fault.length
    cluster.signal_pid(pid, signal.SIGSTOP)
    cluster.frozen.add(pid)

    def thaw() -> None:
        cluster.frozen.discard(pid)
        cluster.signal_pid(pid, signal.SIGCONT)

    detail = {**_task_detail(task), "seconds": round(seconds, 2)}
    return Hit(f"pool process {pid}", detail, [Undo(seconds, f"SIGCONT {pid}", thaw)])


def terminate_backend(fault: Fault, cluster: Cluster) -> Hit:
    sessions = cluster.library_sessions()
    holders = [s for s in sessions if s["holds_lock"]]
    pool = holders if fault.leader and holders else sessions
    if not pool:
        return Hit(None, {"why": "no library session"})
    session = fault.choose(pool)
    with psycopg.connect(cluster.admin_dsn, autocommit=True) as conn:
        ended_at = time.time()  # before: a standby may lead before the call returns
        conn.execute("SELECT pg_terminate_backend(%s)", (session["backend"],))
    name = session["application_name"] or ""
    detail = {"backend": session["backend"], "session": name, "holds_lock": session["holds_lock"]}
    leader = " beat leader " in name
    return Hit(f"backend {session['backend']}", detail, leader_lost=leader, lost_at=ended_at)


def pg_restart(mode: str) -> Callable[[Fault, Cluster], Hit]:
    def restart(fault: Fault, cluster: Cluster) -> Hit:
        started = time.monotonic()
        leading = cluster.leader_pid() is not None
        cluster.pg.restart(mode)
        detail = {"down_s": round(time.monotonic() - started, 2)}
        return Hit(f"postgresql ({mode})", detail, leader_lost=leading)

    return restart


def pg_failover(fault: Fault, cluster: Cluster) -> Hit:
    """The primary crashes and its synchronous replica is promoted; after ``length``
    seconds a new replica of the new primary takes the lost server's port."""
    if cluster.standby is None:
        return Hit(None, {"why": "no standby yet (the last failover's is being built)"})
    started = time.monotonic()
    leading = cluster.leader_pid() is not None
    cluster.fail_over()
    detail = {"down_s": round(time.monotonic() - started, 2), "primary": cluster.pg.port}
    undo = Undo(fault.length, "a new standby of the new primary", cluster.rebuild_standby)
    return Hit("postgresql (failover)", detail, [undo], leader_lost=leading)


def proxy_cut(fault: Fault, cluster: Cluster) -> Hit:
    assert cluster.proxy is not None
    cut = cluster.proxy.cut()
    return Hit("proxy of worker wp", {"connections_cut": cut})


def proxy_blackhole(fault: Fault, cluster: Cluster) -> Hit:
    proxy = cluster.proxy
    assert proxy is not None
    seconds = cluster.lease_of("chaos.short") + fault.length
    proxy.blackhole()
    cluster.blackholes += 1

    def restore() -> None:  # the last of overlapping blackholes restores
        cluster.blackholes -= 1
        if cluster.blackholes == 0:
            proxy.restore()

    undo = Undo(seconds, "end of a blackhole of worker wp", restore)
    return Hit("proxy of worker wp", {"seconds": round(seconds, 2)}, [undo])


def pgbouncer_restart(fault: Fault, cluster: Cluster) -> Hit:
    if cluster.bouncer is None:
        return Hit(None, {"why": "pgbouncer is not installed"})
    started = time.monotonic()
    cluster.bouncer.restart()
    return Hit("pgbouncer", {"down_s": round(time.monotonic() - started, 2)})


def _task_detail(task: dict[str, Any]) -> dict[str, Any]:
    return {key: task[key] for key in ("pid", "task", "slot", "token")}


INJECTORS: dict[str, Callable[[Fault, Cluster], Hit]] = {
    "beat_kill": beat_kill,
    "child_kill": child_kill,
    "worker_kill": worker_kill,
    "freeze": freeze,
    "terminate_backend": terminate_backend,
    "pg_restart_fast": pg_restart("fast"),
    "pg_restart_immediate": pg_restart("immediate"),
    "proxy_cut": proxy_cut,
    "proxy_blackhole": proxy_blackhole,
    "pgbouncer_restart": pgbouncer_restart,
    "pg_failover": pg_failover,
}
