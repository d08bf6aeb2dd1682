"""The campaign runner: start the cluster, inject the seed's faults, go quiet, drain, judge.

1. Servers and processes start (``cluster.Cluster``); the campaign waits until a leader
   (or, active-active, every replica) sends and a first slot succeeded.
2. Fault phase: the schedule drawn from the seed (``faults.draw_schedule``) is applied at
   its times; undo steps (restarts, SIGCONT, a restored proxy) run at theirs, so faults
   overlap. A process that exits by itself is a violation (restarted, so the run goes
   on), also one that never came up: a process started during an outage waits for
   PostgreSQL (guarantee 10).
3. Everything is restored; a quiet period follows (no fault, beat keeps sending) long
   enough for Redis' visibility timeout and the beat leader's sweep of abandoned rows.
4. Invariant (d) is checked on the live system, polled until it holds or a deadline.
5. Drain: beat stops, the workers finish what is queued, then stop (SIGTERM).
6. The checker (``invariants``) judges what was recorded; figures are printed.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import json
import re
import signal
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis

from celery_pglock._keys import default_lock_name, lock_key
from celery_pglock.store._database import DEFAULT_POOL_SIZE
from tests.apps import testapp
from tests.chaos import chaosapp, felt, invariants, liveness
from tests.chaos.cluster import BEATS, POOLER_USER, RECORD_KEY, Cluster, alive
from tests.chaos.faults import KINDS, Fault, Hit, Undo, draw_schedule, inject
from tests.chaos.invariants import Violation
from tests.faults.workload import Report, Sent, log_time
from tests.fixtures.procs import STOP_TIMEOUT, Proc

READY_TIMEOUT = 120.0  # seconds for every process to be up (the machine is shared)
WARM_TIMEOUT = 90.0  # seconds for the first slot to succeed
QUIET_CHECK_TIMEOUT = 45.0  # seconds invariant (d) may take to hold after the quiet period
WATCH_EVERY = 0.25  # seconds between two looks at the processes
TRACK_EVERY = 2.0  # seconds between two records of the processes' children
# A message is counted lost in transit, not a violation, only on all of this evidence: no
# worker's log names it, the broker holds it nowhere (no queue, not kombu's unacked hash),
# and a worker was SIGKILLed within this many seconds of its publish. kombu's Redis
# transport pops a message with one command and records it unacked with the next, so a
# message popped for a consumer that dies in between is gone (kombu #305, celery #7950);
# its ledger row stays `scheduled`, which is the truth: sent, never started.
LOST_IN_TRANSIT = 1.0
PENDING = re.compile(r"^(?P<lock>\S+) (?P<slot>\S+) (?P<task_id>[0-9a-f-]{36}): PENDING$")
ONE_SECOND_ENTRIES = {
    name
    for name, (_, every) in chaosapp.ENTRIES.items()
    if every == 1.0 and name not in chaosapp.BUFFERED_ENTRIES
}


@dataclass
class Options:
    seed: int
    seconds: float = 120.0
    quiet: float = 15.0
    active_active: bool = False
    pooled: bool = False  # every process through PgBouncer's transaction pooling (on rows)
    workdir: Path | None = None
    out: Callable[[str], None] = print


@dataclass
class Logged:
    """One fault as it happened: when (seconds after the fault phase began), what it hit."""

    fault: Fault
    at: float
    took: float
    hit: Hit
    epoch: float = 0.0


@dataclass
class Outcome:
    seed: int
    mode: str
    workdir: Path
    faults: list[Logged] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    # Messages beat published that no worker ever received and the broker no longer has,
    # with a worker SIGKILLed around the publish: lost in transit between Redis and a
    # dying consumer (see LOST_IN_TRANSIT), not a broken promise of the library's.
    lost_in_transit: list[str] = field(default_factory=list)

    @property
    def injected(self) -> int:
        return sum(1 for logged in self.faults if logged.hit.target is not None)

    @property
    def unknown_violations(self) -> list[Violation]:
        """Violations that are not evidence of a known, reported defect."""
        return [v for v in self.violations if invariants.known_defect(v) is None]

    @property
    def last_line(self) -> str:
        found = len(self.violations)
        lost = f"; {len(self.lost_in_transit)} lost in transit" if self.lost_in_transit else ""
        return f"chaos: seed {self.seed}, {self.injected} faults, {found} violations{lost}"


class Campaign:
    """One campaign: ``Campaign(Options(seed=…)).run()`` returns its ``Outcome``."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.out = options.out
        prefix = f"pglock-chaos-{options.seed}-"
        self.workdir = options.workdir or Path(tempfile.mkdtemp(prefix=prefix))
        self.cluster = Cluster(
            self.workdir, active_active=options.active_active, pooled=options.pooled
        )
        mode = "active-active" if options.active_active else "leader"
        mode += " pooled" if options.pooled else ""
        self.outcome = Outcome(options.seed, mode, self.workdir)
        self.ready: set[int] = set()
        self.ready_at: dict[int, float] = {}  # pid -> when it was seen up (epoch)
        self.died_at: dict[int, float] = {}  # pid -> when it was seen dead, unasked (epoch)
        self.window = (0.0, 0.0)  # epochs: the fault phase's start, the drain's start
        self.startup_failures = 0
        self.leader_losses: list[tuple[float, str]] = []  # (epoch, fault kind) the leader lost
        self.t0 = 0.0
        self._undos: list[Undo] = []  # undo steps still due when the fault phase ended
        self._next_watch = 0.0
        self._next_track = 0.0
        self.began = time.monotonic()

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> Outcome:
        options = self.options
        schedule = draw_schedule(options.seed, options.seconds)
        self.out(
            f"chaos: seed {options.seed}, {self.outcome.mode} mode, {options.seconds:g} s of "
            f"faults ({len(schedule)} scheduled), quiet {options.quiet:g} s; logs in {self.workdir}"
        )
        try:
            self._start()
            self._fault_phase(schedule)
            self._restore()
            self._pause(options.quiet, "quiet period")
            state, quiet_found = self._check_quiet()
            report, facts = self._drain_and_collect()
            self._judge(report, facts, state, quiet_found)
        finally:
            self.cluster.close()
        self._print_figures()
        (self.workdir / "report.json").write_text(
            json.dumps(self._as_json(), indent=2, default=str)
        )
        return self.outcome

    def _start(self) -> None:
        cluster = self.cluster
        cluster.start()
        if cluster.bouncer is None:
            self.out(f"chaos: pgbouncer skipped ({cluster.bouncer_missing})")
        for label in cluster.specs:
            cluster.start_worker(label)
        for label in BEATS:
            cluster.start_beat(label)
        self._wait_ready("start-up")
        w = cluster.workload
        lock = default_lock_name(w.namespace, "chaos.short")

        def warm() -> bool:
            self._watch()
            return any(r["state"] == "succeeded" and r["lock_name"] == lock for r in w.ledger())

        self._until(warm, WARM_TIMEOUT, "a first slot to succeed")

    def _fault_phase(self, schedule: list[Fault]) -> None:
        order = itertools.count()
        self.t0 = time.monotonic()
        self.window = (time.time(), 0.0)
        pending: list[tuple[float, int, Fault | Undo]] = [
            (self.t0 + fault.at, next(order), fault) for fault in schedule
        ]
        heapq.heapify(pending)
        end = self.t0 + self.options.seconds
        while True:
            now = time.monotonic()
            if pending and pending[0][0] <= now:
                _, _, item = heapq.heappop(pending)
                for undo in self._apply(item):
                    heapq.heappush(pending, (time.monotonic() + undo.after, next(order), undo))
                continue
            faults_left = any(isinstance(item, Fault) for _, _, item in pending)
            if not faults_left and now >= end:
                break
            self._watch()
            wait = min(pending[0][0] - now if pending else 0.05, end - now, 0.05)
            time.sleep(max(0.0, wait))
        self._undos = [item for _, _, item in sorted(pending) if isinstance(item, Undo)]

    def _apply(self, item: Fault | Undo) -> list[Undo]:
        at = time.monotonic() - self.t0
        if isinstance(item, Undo):
            self.out(f"[{at:6.1f}s]     {item.label}")
            item.action()
            return []
        started, epoch = time.monotonic(), time.time()
        try:
            hit = inject(item, self.cluster)
        except Exception as exc:  # the harness failed, not the system: say so, go on
            hit = Hit(None, {"why": f"injection failed: {type(exc).__name__}: {exc}"})
        took = time.monotonic() - started
        if hit.leader_lost:
            self.leader_losses.append((hit.lost_at or epoch, item.kind))
        self.outcome.faults.append(Logged(item, round(at, 2), round(took, 2), hit, epoch))
        target = hit.target or "nothing"
        detail = " ".join(f"{key}={value}" for key, value in hit.detail.items())
        self.out(f"[{at:6.1f}s] #{item.index:02d} {item.kind:<20} {target}  {detail}")
        return hit.undo

    def _restore(self) -> None:
        """End every fault still in force, bring every process back, wait until all are up."""
        for undo in self._undos:
            self._apply(undo)
        cluster = self.cluster
        for pid in list(cluster.frozen):
            cluster.signal_pid(pid, signal.SIGCONT)
        cluster.frozen.clear()
        if cluster.proxy is not None:
            cluster.blackholes = 0
            cluster.proxy.restore()
        for label in cluster.specs:
            cluster.start_worker(label)
        for label in BEATS:
            cluster.start_beat(label)
        self._wait_ready("restore")

    def _pause(self, seconds: float, label: str) -> None:
        self.out(f"chaos: {label}, {seconds:g} s (at {self._elapsed()})")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._watch()
            time.sleep(0.05)

    # -- watching the processes ---------------------------------------------------------------

    def _wait_ready(self, phase: str) -> None:
        def up() -> bool:
            self._watch(force=True)
            current = [*self.cluster.workers.values(), *self.cluster.beats.values()]
            return all(proc.pid in self.ready for proc in current)

        self._until(up, READY_TIMEOUT, f"every process to be up ({phase})")

    def _elapsed(self) -> str:
        return f"{time.monotonic() - self.began:.0f} s"

    def _until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
            time.sleep(0.1)

    def _watch(self, *, force: bool = False) -> None:
        """Note processes that came up; restart those that died (unasked: a violation)."""
        now = time.monotonic()
        if not force and now < self._next_watch:
            return
        self._next_watch = now + WATCH_EVERY
        cluster, w = self.cluster, self.cluster.workload
        groups: list[tuple[dict[str, Proc], Callable[[str], Proc]]] = [
            (cluster.workers, cluster.start_worker),
            (cluster.beats, cluster.start_beat),
        ]
        for procs, start in groups:
            for label, proc in list(procs.items()):
                if proc.alive:
                    if proc.pid not in self.ready and cluster.ready(proc):
                        self.ready.add(proc.pid)
                        self.ready_at[proc.pid] = time.time()
                    continue
                if proc.pid in w.killed:
                    continue
                w.killed.add(proc.pid)  # accounted for here
                self._died(proc)
                start(label)
        if now >= self._next_track:
            self._next_track = now + TRACK_EVERY
            cluster.track()

    def _died(self, proc: Proc) -> None:
        at = time.monotonic() - self.t0 if self.t0 else 0.0
        self.died_at[proc.pid] = time.time()
        tail = " | ".join(proc.log_tail(6).splitlines())
        how = "exited by itself"
        if proc.pid not in self.ready:
            self.startup_failures += 1
            how = "failed to start"
        text = f"{proc.name} (pid {proc.pid}) {how} ({proc.returncode}): {tail}"
        self.outcome.violations.append(Violation("run", text))
        self.out(f"[{at:6.1f}s]     VIOLATION {text}")

    # -- (d), then the drain ------------------------------------------------------------------

    def lock_names(self) -> dict[int, str]:
        namespace = self.cluster.workload.namespace
        names = [default_lock_name(namespace, task) for task, _ in chaosapp.ENTRIES.values()]
        names.append(self.leader_lock)
        return {lock_key(name): name for name in names}

    @property
    def leader_lock(self) -> str:
        return f"{self.cluster.workload.namespace}:beat-leader"

    def _snapshot(self) -> invariants.QuietState:
        cluster = self.cluster
        locks, sessions = cluster.advisory_locks(), cluster.library_sessions()
        running, open_runs = cluster.running_rows(), cluster.open_executions()
        # Alive means: a live beat or worker of the campaign, or a pool process of a live
        # worker (an orphaned pool process of a killed worker does not count).
        live = [proc for _, proc in cluster.live_beats() + cluster.live_workers()]
        ours = {proc.pid for proc in live} | cluster.pool_processes()
        return invariants.QuietState(
            locks=locks,
            sessions=sessions,
            running=running,
            open_executions=open_runs,
            alive={pid for pid in ours if alive(pid)},
            beat_pids={proc.pid for proc in cluster.workload.beats},
            names=self.lock_names(),
            leader_lock=self.leader_lock,
            pool_size=DEFAULT_POOL_SIZE,
            pooler_user=POOLER_USER if cluster.bouncer is not None else None,
        )

    def _check_quiet(self) -> tuple[invariants.QuietState, list[Violation]]:
        """Invariant (d), polled: transient states (a release in flight) may not count."""
        deadline = time.monotonic() + QUIET_CHECK_TIMEOUT
        while True:
            self._watch()
            state = self._snapshot()
            found = invariants.quiet(state)
            if not found or time.monotonic() > deadline:
                return state, found
            time.sleep(0.5)

    def _drain_and_collect(self) -> tuple[Report, dict[str, Any]]:
        cluster, w = self.cluster, self.cluster.workload
        self.out(f"chaos: drain: beat stops, the workers finish (at {self._elapsed()})")
        self.window = (self.window[0], time.time())
        for proc in cluster.beats.values():
            w.stopping.add(proc.pid)
            proc.terminate()
        for proc in cluster.beats.values():
            # One SIGTERM only (see Workload.stop): a second one kills a clean exit.
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(STOP_TIMEOUT)
            proc.stop()
        published = self._published()
        executions, skips = w.executions(), w.skips()
        w.sent = _messages(published, w.beat_sends(), executions, skips)
        w.stop(drain_rows=False)
        if cluster.bouncer is not None:
            cluster.bouncer.stop()  # its server sessions carry the names of our processes
        report = w.check()
        facts = {
            "executions": w.executions(),
            "writes": cluster.fenced_writes(),
            "ledger": w.ledger(),
            "skips": w.skips(),
            "beat_sends": w.beat_sends(),
            "published": published,
        }
        facts["metas"] = w.metas(message.result.id for message in w.sent)
        facts["broker"] = self._broker_snapshot()
        (self.workdir / "facts.json").write_text(json.dumps(facts, indent=1, default=str))
        return report, facts

    def _broker_snapshot(self) -> dict[str, Any]:
        """Where messages still are once the workers stopped: each queue's task ids, kombu's
        ``unacked`` hash (delivered, not acknowledged) and its restore mutex."""
        assert self.cluster.redis is not None
        client = redis.Redis.from_url(self.cluster.redis.url)
        found: dict[str, Any] = {"queues": {}, "unacked": [], "mutex_ttl": None}
        with client:
            for key in client.scan_iter(count=1000):
                kind = client.type(key)
                if kind == b"list":
                    raw = client.lrange(key, 0, -1)
                    found["queues"][key.decode()] = [_task_id(json.loads(m)) for m in raw]
            for _, raw in (client.hgetall("unacked") or {}).items():
                found["unacked"].append(_task_id(json.loads(raw)[0]))
            if client.exists("unacked_mutex"):
                found["mutex_ttl"] = client.ttl("unacked_mutex")
        return found

    def _published(self) -> list[dict[str, Any]]:
        client = redis.Redis.from_url(self.cluster.record_url)
        with client:
            return [json.loads(raw) for raw in client.lrange(RECORD_KEY, 0, -1)]

    # -- judging --------------------------------------------------------------------------------

    def _judge(
        self,
        report: Report,
        facts: dict[str, Any],
        state: invariants.QuietState,
        quiet_found: list[Violation],
    ) -> None:
        cluster, w = self.cluster, self.cluster.workload
        executions, writes, ledger = facts["executions"], facts["writes"], facts["ledger"]
        skips, beat_sends, published = facts["skips"], facts["beat_sends"], facts["published"]
        beat_pids = {proc.pid for proc in w.beats}
        found = self.outcome.violations
        found += [Violation("a", text) for text in report.succeeded_twice]
        found += invariants.fences(writes)
        overlap_found, seen = invariants.overlaps(executions, writes)
        found += overlap_found
        found += quiet_found
        found += [Violation("d", f"after stop: {text}") for text in report.held_locks]
        found += [Violation("d", f"after stop: {text}") for text in report.open_sessions]
        found += invariants.sends(published, beat_sends, [*executions, *skips, *ledger], beat_pids)
        succeeded, sent = invariants.slot_success(beat_sends, ledger, ONE_SECOND_ENTRIES)
        deadlocks = sum(proc.log_text().count("deadlock detected") for proc in w.beats)
        stretches = felt.judge(self._record(), ledger)
        found += [
            Violation("f", str(gap))
            for gaps in stretches.values()
            for gap in liveness.over_bound(gaps)
        ]
        found += self._unsettled(report, published, facts["broker"])
        found += [Violation("run", f"on SIGTERM: {text}") for text in report.crashed]

        elections = [
            log_time(line)
            for proc in w.beats
            for line in proc.log_text().splitlines()
            if "is now the leader" in line
        ]
        losses = self.leader_losses
        gaps = {
            kind: invariants.failover_gaps([at for at, k in losses if k == kind], elections)
            for kind in sorted({k for _, k in losses})
        }
        every_gap = [gap for found in gaps.values() for gap in found]
        short_slots = [row["slot"] for row in beat_sends if row["entry"] == "short"]
        injected = Counter(lf.fault.kind for lf in self.outcome.faults if lf.hit.target)
        missed = Counter(lf.fault.kind for lf in self.outcome.faults if not lf.hit.target)
        refused = [
            (row, kind)
            for row in executions
            for kind in ("start", "end")
            if row[f"{kind}_result"] == "refused"
        ]
        entries = {
            name: invariants.slot_success(beat_sends, ledger, {name})
            for name in chaosapp.ENTRIES
            if any(row["entry"] == name for row in beat_sends)
        }
        worst = {name: liveness.worst(gaps) for name, gaps in stretches.items()}
        pooler = sum(1 for s in state.sessions if s["usename"] == POOLER_USER)
        self.outcome.figures = {
            "seed": self.options.seed,
            "mode": self.outcome.mode,
            "seconds": self.options.seconds,
            "faults_scheduled": len(self.outcome.faults),
            "faults": {kind: injected[kind] for kind in KINDS if injected[kind]},
            "faults_without_target": dict(missed),
            "pgbouncer": "yes" if cluster.bouncer is not None else cluster.bouncer_missing,
            "slots": len(ledger),
            "slot_states": dict(Counter(row["state"] for row in ledger)),
            "one_second_slots": {"succeeded": succeeded, "sent": sent},
            "entries": {
                name: {"succeeded": s, "sent": n, **_worst_gap(worst.get(name))}
                for name, (s, n) in entries.items()
            },
            "executions": len(executions),
            "executions_by_task": dict(Counter(row["task"] for row in executions)),
            "skips": dict(Counter(row["reason"] for row in skips)),
            "stale_writes_refused": len(refused),
            "refused_after_learning_lost": sum(1 for row, kind in refused if row[f"{kind}_lost"]),
            "overlaps": asdict(seen),
            "leader_losses": len(self.leader_losses),
            "max_failover_gap_s": round(max(every_gap), 3) if every_gap else None,
            "max_failover_gap_by_fault_s": {k: round(max(g), 3) for k, g in gaps.items() if g},
            "largest_gap_between_1s_slots_s": round(invariants.largest_hole(short_slots), 1),
            "connections_after_quiet": {
                "library_sessions": sum(state.counts.values()),
                "processes": len(state.counts),
                "max_per_process": max(state.counts.values(), default=0),
                "pgbouncer_server_sessions": pooler,
            },
            "beat_claim_deadlocks": deadlocks,
            "startup_failures": self.startup_failures,
            "published_by_beats": sum(1 for r in published if r["pid"] in beat_pids),
            "resent_claims": sum(1 for row in beat_sends if row["sends"] > 1),
            "wall_clock_s": round(time.monotonic() - self.began),
            "messages": len(w.sent),
        }

    def _record(self) -> felt.Record:
        """What invariant (f) needs of the campaign's record (``felt``)."""
        cluster, w = self.cluster, self.cluster.workload
        queue, tx_queue = w.env["TEST_QUEUE"], w.env.get("CHAOS_TX_QUEUE")
        faults = [
            {
                "kind": logged.fault.kind,
                "epoch": logged.epoch,
                "took": logged.took,
                "target": logged.hit.target,
                "detail": logged.hit.detail,
            }
            for logged in self.outcome.faults
        ]
        workers = [
            (cluster.specs[proc.name.removeprefix("worker-")].queue, up, self._gone_at(proc.pid))
            for proc in w.workers
            if (up := self.ready_at.get(proc.pid)) is not None
        ]
        return felt.Record(
            window=self.window,
            faults=faults,
            workers=workers,
            queues={
                name: tx_queue if name == "tx" and tx_queue else queue for name in chaosapp.ENTRIES
            },
            worker_queues={label: spec.queue for label, spec in cluster.specs.items()},
            behind_bouncer=frozenset({"tx"} if tx_queue else ()),
            proxied_queue=queue,
            leases={task: cluster.recovery_lease(task) for task, _ in chaosapp.ENTRIES.values()},
        )

    def _gone_at(self, pid: int) -> float:
        """When a worker stopped consuming: killed, found dead, or still up at the end."""
        return self.cluster.deaths.get(pid) or self.died_at.get(pid) or self.window[1]

    def _unsettled(
        self, report: Report, published: list[dict[str, Any]], broker: dict[str, Any]
    ) -> list[Violation]:
        """(g), with evidence for a message left PENDING: whether any worker ever logged
        it, where the broker has it now, and the nearest SIGKILL of a worker."""
        w = self.cluster.workload
        logs = "\n".join(proc.log_text() for proc in w.workers)
        sent_at = {r["task_id"]: r["at"] for r in published}
        kills = [f for f in self.outcome.faults if f.fault.kind == "worker_kill" and f.hit.target]
        unseen: set[tuple[str, str]] = set()
        lost: set[tuple[str, str]] = set()
        found = []
        for text in report.unsettled:
            match = PENDING.match(text)
            if match is None or match["task_id"] in logs or match["task_id"] not in sent_at:
                found.append(Violation("g", text))
                continue
            unseen.add((match["lock"], match["slot"]))
            at = sent_at[match["task_id"]]
            where = _whereabouts(match["task_id"], broker)
            evidence = "; no worker ever received it" + where
            near = min(kills, key=lambda f: abs(f.epoch - at)) if kills else None
            if near is not None:
                evidence += f"; nearest worker SIGKILL: {near.hit.target}, {near.epoch - at:+.3f} s"
            if near is not None and where == NOWHERE and abs(near.epoch - at) <= LOST_IN_TRANSIT:
                lost.add((match["lock"], match["slot"]))
                self.outcome.lost_in_transit.append(text + evidence)
                continue
            found.append(Violation("g", text + evidence))
        for text in report.unresolved:
            lock, slot = text.split(" ", 2)[:2]
            key = (lock, slot.rstrip(":"))
            if key in lost and "left scheduled" in text:
                continue  # the row of a message lost in transit: sent, never started
            note = " (its message never reached a worker, above)" if key in unseen else ""
            found.append(Violation("g", text + note))
        return found

    def _print_figures(self) -> None:
        f, out = self.outcome.figures, self.out
        if not f:
            return
        kinds = ", ".join(f"{kind} {count}" for kind, count in f["faults"].items())
        out(f"faults by kind: {kinds}")
        if f["faults_without_target"]:
            missed = ", ".join(f"{k} {n}" for k, n in f["faults_without_target"].items())
            out(f"faults that found no target: {missed}")
        states = ", ".join(f"{k} {n}" for k, n in sorted(f["slot_states"].items()))
        one = f["one_second_slots"]
        share = 100 * one["succeeded"] / one["sent"] if one["sent"] else 0.0
        out(
            f"slots: {f['slots']} ({states}); 1-s slots succeeded: "
            f"{one['succeeded']}/{one['sent']} ({share:.1f} %)"
        )
        gaps = [
            f"{name} {e['worst_gap_s']} s (bound {e['worst_gap_bound_s']} s, "
            f"{e['worst_gap_faults']} faults)"
            for name, e in f["entries"].items()
            if "worst_gap_s" in e
        ]
        out(f"longest stretch without a success, unreachable time deducted: {'; '.join(gaps)}")
        per_task = ", ".join(f"{k} {n}" for k, n in sorted(f["executions_by_task"].items()))
        out(f"executions: {f['executions']} ({per_task}); messages: {f['messages']}")
        skips = ", ".join(f"{k} {n}" for k, n in sorted(f["skips"].items())) or "none"
        out(f"skips by reason: {skips}")
        o = f["overlaps"]
        out(
            f"stale writes refused: {f['stale_writes_refused']} "
            f"({f['refused_after_learning_lost']} after check() said lost); overlaps: "
            f"{o['fenced_out']} fenced out, {o['silent']} without a write, "
            f"{o['before_first_write']} written before the newer holder's first write"
        )
        gap = f["max_failover_gap_s"]
        by_fault = ", ".join(f"{k} {g:.3f} s" for k, g in f["max_failover_gap_by_fault_s"].items())
        out(
            f"max failover gap (beat): {'n/a' if gap is None else f'{gap:.3f} s'} over "
            f"{f['leader_losses']} leader losses ({by_fault or 'none'}); largest gap between "
            f"1-s slots sent: {f['largest_gap_between_1s_slots_s']} s"
        )
        c = f["connections_after_quiet"]
        out(
            f"connections after quiet: {c['library_sessions']} library sessions in "
            f"{c['processes']} processes (max {c['max_per_process']} per process), "
            f"{c['pgbouncer_server_sessions']} PgBouncer server sessions"
        )
        out(
            f"messages published by beat: {f['published_by_beats']} "
            f"(claims re-sent: {f['resent_claims']}, deadlocked: {f['beat_claim_deadlocks']}); "
            f"processes that failed to start: {f['startup_failures']}; "
            f"{f['wall_clock_s']} s in all"
        )
        for lost in self.outcome.lost_in_transit:
            out(f"lost in transit (not a violation, see LOST_IN_TRANSIT): {lost}")
        for violation in self.outcome.violations:
            known = invariants.known_defect(violation)
            note = f"  [known defect {known.name}: {known.summary}; {known.test}]" if known else ""
            out(f"VIOLATION {violation}{note}")
        out(self.outcome.last_line)

    def _as_json(self) -> dict[str, Any]:
        return {
            "figures": self.outcome.figures,
            "violations": [str(v) for v in self.outcome.violations],
            "lost_in_transit": self.outcome.lost_in_transit,
            "faults": [
                {
                    "at": lf.at,
                    "epoch": lf.epoch,
                    "took": lf.took,
                    **asdict(lf.fault),
                    "target": lf.hit.target,
                    "detail": lf.hit.detail,
                }
                for lf in self.outcome.faults
            ],
            "pids": {str(pid): owner for pid, owner in sorted(self.cluster.owners.items())},
            "liveness_record": asdict(self._record()),  # replays invariant (f): felt.judge
            "last_line": self.outcome.last_line,
        }


NOWHERE = "; nowhere in the broker"


def _worst_gap(gap: liveness.Gap | None) -> dict[str, Any]:
    """An entry's longest stretch without a success, for the figures (report.json)."""
    if gap is None:
        return {}
    return {
        "worst_gap_s": round(gap.seconds, 1),
        "worst_gap_bound_s": round(gap.allowed, 1),
        "worst_gap_faults": gap.faults,
    }


def _whereabouts(task_id: str, broker: dict[str, Any]) -> str:
    """Where the broker snapshot has the message."""
    queues = [name for name, ids in broker["queues"].items() if task_id in ids]
    if queues:
        return f"; still queued in {queues}"
    if task_id in broker["unacked"]:
        ttl = broker["mutex_ttl"]
        held = f", restore mutex held for {ttl} s more" if ttl is not None else ""
        return f"; in kombu's unacked hash, never restored{held}"
    return NOWHERE


def _task_id(message: dict[str, Any]) -> str | None:
    return (message.get("headers") or {}).get("id")


def _messages(
    published: list[dict[str, Any]],
    beat_sends: list[dict[str, Any]],
    executions: list[dict[str, Any]],
    skips: list[dict[str, Any]],
) -> list[Sent]:
    """Every message of the campaign (published, or seen by a worker), once per task id."""
    locks = {(row["entry"], row["slot"]): row["lock_name"] for row in beat_sends}
    found: dict[str, tuple[str, str | None]] = {}
    for row in [*executions, *skips]:
        if row["task_id"]:
            found.setdefault(row["task_id"], (row["lock_name"], row["slot"]))
    for record in published:
        lock = locks.get((record["entry"], record["slot"]))
        if record["task_id"] and lock:
            found.setdefault(record["task_id"], (lock, record["slot"]))
    return [
        Sent(testapp.app.AsyncResult(task_id), lock, slot)
        for task_id, (lock, slot) in found.items()
    ]
