"""The fault workload and its checker.

A ``Workload`` runs real ``celery worker`` and ``celery beat`` processes of
``tests.faults.faultapp`` on a schema, queue and lock namespace of its own: beat
(``PgLockScheduler``) sends ``faults.periodic`` every second, the test sends ad-hoc slotted
jobs (often several copies of one slot), injects its faults, and measures how long the
processes take to serve a fresh job afterwards. ``stop()`` ends the processes the way an
operator would (SIGTERM), and ``check()`` returns a ``Report`` of every violation of:

- no (lock name, slot) succeeded twice: at most one ``SUCCESS`` token per slot, and it is
  the ledger's token, whose execution finished;
- every slot is resolved: its ledger row is ``succeeded``, or ``failed`` with a reason;
  every message sent reached ``SUCCESS``, ``FAILURE`` (with its error) or ``SKIPPED``
  (with its reason); every beat claim was published;
- nothing is left behind: no advisory lock of the namespace is held and no session of
  these processes is open once they stopped;
- the processes recovered by themselves: none died unasked, all exited cleanly.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import redis
from celery.result import AsyncResult
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock._keys import lock_key, split_key
from tests.apps import testapp
from tests.apps.harness import app_env, configure_client, redis_result_backend
from tests.fixtures.measurements import MEASUREMENTS
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import STOP_TIMEOUT, Proc, Procs, wait_until

T = TypeVar("T")

APP = "tests.faults.faultapp"
HOSTNAME = socket.gethostname()
READY_TIMEOUT = 30.0  # seconds for a worker or beat to come up; the machine is shared
SETTLE_TIMEOUT = 60.0  # seconds for sent messages to reach a final state
GONE_TIMEOUT = 10.0  # seconds for the server to end the sessions of stopped processes
FINAL_STATES = frozenset({"SUCCESS", "FAILURE", "SKIPPED"})
# "celery-pglock <pid>@host" (pooled), "celery-pglock beat leader|standby <pid>@host",
# "pglock <pid> <task id> <host>" (a holder).
_OUR_SESSION = re.compile(r"^(?:celery-pglock(?: beat \w+)? (\d+)@|pglock (\d+) )")


@dataclass(frozen=True)
class Sent:
    """One message the test sent."""

    result: AsyncResult[Any]
    lock: str
    slot: str | None


@dataclass
class Report:
    """What ``Workload.check`` found; every list empty means the run kept the promises."""

    succeeded_twice: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)
    unsettled: list[str] = field(default_factory=list)
    held_locks: list[str] = field(default_factory=list)
    open_sessions: list[str] = field(default_factory=list)
    crashed: list[str] = field(default_factory=list)
    slots: int = 0
    executions: int = 0


@dataclass
class Run:
    """A module's run: its workload, what the checker found, and what its faults left."""

    workload: Workload
    report: Report = field(default_factory=Report)
    facts: dict[str, Any] = field(default_factory=dict)

    @property
    def procs(self) -> Procs:
        """The run's processes (their logs go into a failed test's report)."""
        return self.workload.procs


class Invariants:
    """The promises every fault run keeps, one test each. A fault module judges its run
    (its ``run`` fixture) with ``class TestInvariants(Invariants)``; ``min_slots``: how
    many slots its scenario must have produced at least, so that a run that did nothing
    cannot pass."""

    min_slots = 0

    def test_no_slot_succeeded_twice(self, run: Run) -> None:
        """Across every fault of the run, no (lock name, slot) succeeded twice."""
        assert [] == run.report.succeeded_twice
        assert run.report.slots >= self.min_slots

    def test_every_slot_and_message_is_resolved(self, run: Run) -> None:
        """Every slot succeeded or failed with a reason; every message ended with a final
        state (SUCCESS, SKIPPED with a reason, FAILURE with its error)."""
        assert ([], []) == (run.report.unresolved, run.report.unsettled)

    def test_nothing_is_left_behind(self, run: Run) -> None:
        """Once the processes stopped, no lock of the namespace is held, no session is open."""
        assert ([], []) == (run.report.held_locks, run.report.open_sessions)

    def test_processes_recovered_by_themselves(self, run: Run) -> None:
        """No process died or needed a restart by hand; all exited cleanly on SIGTERM."""
        assert [] == run.report.crashed, run.workload.exit_codes


class Workload:
    """Worker and beat processes of ``faultapp`` on a schema, queue and namespace of its own."""

    def __init__(
        self,
        *,
        name: str,
        admin_dsn: str,
        app_dsn: str,
        redis_url: str,
        procs: Procs,
        schema: str | None = None,
        app: str = APP,
        **extra: Any,
    ) -> None:
        self.name = name
        self.app = app
        self.admin_dsn = admin_dsn
        self.schema = schema or f"t_{uuid.uuid4().hex[:12]}"
        self.namespace = f"{name}-{uuid.uuid4().hex[:8]}"
        self.procs = procs
        self.redis_url = redis_url
        self.env = app_env(
            pg_dsn=app_dsn,
            schema=self.schema,
            broker_url=redis_url,
            backend_url=redis_result_backend(redis_url),
            TEST_NAMESPACE=self.namespace,
            TEST_BEAT_TASK="faults.periodic",
            **extra,
        )
        self.sent: list[Sent] = []
        self.workers: list[Proc] = []
        self.beats: list[Proc] = []
        self.killed: set[int] = set()  # pids the test ended on purpose
        self.stopping: set[int] = set()  # pids being stopped at the end of the run
        self.pids: set[int] = set()
        self.gates = procs.log_dir / "gates"
        self.gates.mkdir(exist_ok=True)
        self.exit_codes: dict[str, int] = {}
        self.ready_lines: dict[int, str] = {}  # worker pid -> the log line saying it consumes
        self._count = 0

    # -- processes -----------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the schema (if missing) and the executions table; point the client here."""
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(self.schema))
            )
        configure_client(self.env)

    def worker(
        self,
        label: str = "w",
        *,
        concurrency: int = 2,
        queue: str | None = None,
        wait: bool = True,
        pool: str = "prefork",
        **env: str,
    ) -> Proc:
        """Start a worker (``pool``: prefork, or threads whose locks share a session) on
        ``queue`` (default: this workload's); wait until ready (``wait=False``: return at
        once, see ``worker_ready``)."""
        queue = queue or self.env["TEST_QUEUE"]
        node = f"{label}-{queue}"
        proc = self.procs.celery(
            self.app,
            "worker",
            *("-P", pool, "-c", str(concurrency), "-n", f"{node}@%h"),
            *("--without-gossip", "--without-mingle", "--without-heartbeat"),
            *("-l", "info", "-Q", queue),
            env={**self.env, **env},
            name=f"worker-{label}",
        )
        self.ready_lines[proc.pid] = f"{node}@{HOSTNAME} ready."
        self.workers.append(proc)
        if wait:
            proc.wait_for_log(self.ready_lines[proc.pid], timeout=READY_TIMEOUT)
            self.track()
        return proc

    def worker_ready(self, proc: Proc) -> bool:
        """Whether a worker started with ``wait=False`` consumes by now."""
        return self.ready_lines[proc.pid] in proc.log_text()

    def beat(self, label: str = "b", *, lead: bool | None = True, **env: str) -> Proc:
        """Start a beat replica sending ``faults.periodic`` every second.

        ``lead``: wait until it leads (False: until it stands by; None: do not wait).
        """
        proc = self.procs.celery(
            self.app,
            "beat",
            "-l",
            "info",
            env={**self.env, "TEST_BEAT_EVERY": "1", **env},
            name=f"beat-{label}",
        )
        self.beats.append(proc)
        self.pids.add(proc.pid)
        if lead:
            proc.wait_for_log("is now the leader", timeout=READY_TIMEOUT)
        elif lead is False:
            self.wait_for(
                lambda: self.standing_by(proc),
                timeout=READY_TIMEOUT,
                message=f"{proc!r} waiting for leadership",
            )
        return proc

    def standing_by(self, proc: Proc) -> bool:
        """Whether beat ``proc`` waits in the server's lock queue for leadership."""
        query = """
            SELECT 1 FROM pg_stat_activity
             WHERE application_name = %s AND wait_event_type = 'Lock'
        """
        name = f"celery-pglock beat standby {proc.pid}@{HOSTNAME}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            return conn.execute(query, (name,)).fetchone() is not None

    def leader_since(self, proc: Proc, after: float) -> float | None:
        """Epoch seconds of the first "is now the leader" line of ``proc`` after ``after``."""
        for line in proc.log_text().splitlines():
            if "is now the leader" in line:
                moment = log_time(line)
                if moment > after:
                    return moment
        return None

    def track(self) -> None:
        """Remember the pids of the processes and of their children (sessions to look for)."""
        for proc in [*self.workers, *self.beats]:
            self.pids.add(proc.pid)
            self.pids.update(proc.descendants())

    def alive_check(self) -> None:
        """Fail at once, with the log, when a process the test did not end has died."""
        for proc in [*self.workers, *self.beats]:
            if not proc.alive and proc.pid not in self.killed | self.stopping:
                raise AssertionError(f"{proc!r} exited by itself:\n{proc.log_tail()}")

    def wait_for(
        self, predicate: Callable[[], T], *, message: str, timeout: float = SETTLE_TIMEOUT
    ) -> T:
        """``wait_until(predicate)``, failing at once should one of our processes die."""

        def checked() -> T:
            self.alive_check()
            return predicate()

        return wait_until(checked, timeout=timeout, interval=0.02, message=message)

    def drain(self, timeout: float = SETTLE_TIMEOUT, *, rows: bool = True) -> None:
        """Once beat stopped: let the workers finish what is queued or waiting for a retry.

        ``rows=False``: wait for the messages only, not for every ledger row to resolve (a
        row nothing will resolve would hold the drain for ``timeout``). What is still
        unresolved at the deadline is left for the checker to report.
        """

        def unresolved() -> list[str]:
            self.alive_check()
            report = Report()
            ids = [s.result.id for s in self.sent]
            _check_resolved(
                report,
                sent=self.sent,
                ledger=self.ledger(),
                sends=self.beat_sends(),
                skips=self.skips(),
                metas=self.metas(ids),
            )
            return (report.unresolved if rows else []) + report.unsettled

        with contextlib.suppress(AssertionError):
            wait_until(lambda: not unresolved(), timeout=timeout, interval=0.2, message="drain")

    def retire(self, proc: Proc) -> int:
        """Stop one process (SIGTERM) mid-run, as an operator would; return its exit code."""
        self.track()
        self.killed.add(proc.pid)
        code = proc.stop()
        self.exit_codes[proc.name] = code
        return code

    def stop(self, *, drain_rows: bool = True) -> None:
        """SIGTERM everything, beat first, as an operator would; note the exit codes.

        Before the workers stop they drain (``drain(rows=drain_rows)``)."""
        self.track()
        self.pids.update(row["pid"] for row in self.executions())
        for group in (self.beats, self.workers):
            if group is self.workers:
                self.drain(rows=drain_rows)
            for proc in group:
                self.stopping.add(proc.pid)
                proc.terminate()
            for proc in group:
                # One SIGTERM only: a second one during interpreter shutdown (handlers
                # already reset) would kill a cleanly exiting process.
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(STOP_TIMEOUT)
                code = proc.stop()
                if proc.pid not in self.killed:
                    self.exit_codes[proc.name] = code

    def drop(self) -> None:
        """Drop the schema (runs on the shared server)."""
        drop_schema(self.admin_dsn, self.schema)

    # -- sending -------------------------------------------------------------------------

    def key(self, prefix: str = "k") -> str:
        self._count += 1
        return f"{prefix}{self._count}"

    def send(
        self,
        key: str,
        *,
        slot: str | None = None,
        copies: int = 1,
        task: str = "faults.job",
        queue: str | None = None,
        **kwargs: Any,
    ) -> list[Sent]:
        """Send ``copies`` messages of job ``key`` (same lock, same slot)."""
        headers = {"pglock_slot": slot} if slot is not None else {}
        lock = f"{self.namespace}:job:{key}"
        sent = [
            Sent(
                testapp.app.send_task(
                    task, kwargs={"key": key, **kwargs}, headers=headers, queue=queue
                ),
                lock,
                slot,
            )
            for _ in range(copies)
        ]
        self.sent.extend(sent)
        return sent

    def gate(self) -> Path:
        """A closed gate for a job (``gate=str(path)``); ``path.touch()`` opens it."""
        return self.gates / uuid.uuid4().hex

    def settle(self, sent: Iterable[Sent], timeout: float = SETTLE_TIMEOUT) -> list[str]:
        """Wait until every message reached a final state; return the states."""
        sent = list(sent)

        def states() -> list[str] | None:
            self.alive_check()
            found = [str(s.result.state) for s in sent]
            return found if all(state in FINAL_STATES for state in found) else None

        found = wait_until(states, timeout=timeout, interval=0.1, message=f"{len(sent)} results")
        assert found is not None
        return found

    def running(self, key: str, timeout: float = SETTLE_TIMEOUT) -> dict[str, Any]:
        """Wait for the unfinished execution of job ``key`` and return it."""
        lock = f"{self.namespace}:job:{key}"

        def started() -> dict[str, Any] | None:
            self.alive_check()
            rows = [r for r in self.executions() if r["lock_name"] == lock and not r["finished"]]
            return rows[-1] if rows else None

        row = wait_until(started, timeout=timeout, interval=0.05, message=f"job {key} running")
        assert row is not None
        return row

    def recovery(self, label: str, since: float, timeout: float = SETTLE_TIMEOUT) -> float:
        """Send a fresh job now; seconds from ``since`` (monotonic) until it succeeded.

        Recorded in ``MEASUREMENTS`` under ``<workload>: <label>``.
        """
        [probe] = self.send(self.key("probe"), slot="probe")
        self.wait_for(
            lambda: probe.result.state == "SUCCESS",
            timeout=timeout,
            message=f"a fresh job to succeed after {label}",
        )
        seconds = time.monotonic() - since
        MEASUREMENTS[f"{self.name}: {label}"] = round(seconds, 3)
        return seconds

    def beat_recovery(self, label: str, since: float, timeout: float = SETTLE_TIMEOUT) -> float:
        """Seconds from ``since`` (monotonic) until a beat slot due later has executed."""
        since_epoch = time.time() - (time.monotonic() - since)

        def executed() -> bool:
            self.alive_check()
            rows = self.executions("faults.periodic")
            return any(r["finished"] and r["started"].timestamp() > since_epoch for r in rows)

        wait_until(executed, timeout=timeout, interval=0.05, message=f"beat after {label}")
        seconds = time.monotonic() - since
        MEASUREMENTS[f"{self.name}: {label}"] = round(seconds, 3)
        return seconds

    # -- what happened -------------------------------------------------------------------

    def executions(self, task: str | None = None) -> list[dict[str, Any]]:
        where = "WHERE task = %(task)s" if task else ""
        return self.rows(f"SELECT * FROM {{}} {where} ORDER BY id", "executions", {"task": task})

    def ledger(self) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM {} ORDER BY lock_name, slot", "pglock_runs")

    def skips(self) -> list[dict[str, Any]]:
        return self.rows("SELECT * FROM {} ORDER BY id", "pglock_skips")

    def beat_sends(self) -> list[dict[str, Any]]:
        return self.rows(
            "SELECT * FROM {} WHERE namespace = %(ns)s ORDER BY slot",
            "pglock_beat_sends",
            {"ns": self.namespace},
        )

    def rows(
        self, text: str, table: str, params: dict[str, Any] | None = None
    ) -> list[dict[str, Any]]:
        query = sql.SQL(text).format(sql.Identifier(self.schema, table))
        with (
            psycopg.connect(self.admin_dsn, autocommit=True) as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return cur.execute(query, params or {}).fetchall()

    def metas(self, task_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The result-backend meta of each task id (absent: never stored)."""
        ids = sorted({tid for tid in task_ids if tid})
        client = redis.Redis.from_url(redis_result_backend(self.redis_url))
        found: dict[str, dict[str, Any]] = {}
        with client:
            for start in range(0, len(ids), 500):
                chunk = ids[start : start + 500]
                values = client.mget([f"celery-task-meta-{tid}" for tid in chunk])
                found.update({t: json.loads(v) for t, v in zip(chunk, values, strict=True) if v})
        return found

    def logs(self) -> str:
        """Everything every process of this workload wrote."""
        return "\n".join(proc.log_text() for proc in self.procs.started)

    # -- the checker -----------------------------------------------------------------------

    def check(self) -> Report:
        """Check the promises (see the module docstring); call after ``stop()``."""
        report = Report()
        executions, ledger = self.executions(), self.ledger()
        skips, sends = self.skips(), self.beat_sends()
        ids = [s.result.id for s in self.sent] + [r["task_id"] for r in executions]
        metas = self.metas(ids)
        report.executions = len(executions)
        _check_successes(report, executions, ledger, metas)
        _check_resolved(
            report, sent=self.sent, ledger=ledger, sends=sends, skips=skips, metas=metas
        )
        names = {r["lock_name"] for r in [*executions, *ledger, *skips] if r["lock_name"]}
        names |= {s.lock for s in self.sent if _lockable(s.lock)}
        names |= {f"{self.namespace}:beat-leader"}
        report.held_locks = held_locks(self.admin_dsn, names)
        lease = float(self.env.get("TEST_LEASE", "30"))
        report.held_locks += held_rows(self.admin_dsn, self.schema, names, lease + GONE_TIMEOUT)
        report.open_sessions = open_sessions(self.admin_dsn, self.pids)
        report.crashed = [f"{name} exited {code}" for name, code in self.exit_codes.items() if code]
        report.slots = len(ledger)
        return report


def _check_successes(
    report: Report,
    executions: list[dict[str, Any]],
    ledger: list[dict[str, Any]],
    metas: dict[str, dict[str, Any]],
) -> None:
    by_token = {row["token"]: row for row in executions if row["token"] is not None}
    won: dict[tuple[str, str], set[int]] = {}
    for task_id, meta in metas.items():
        if meta.get("status") != "SUCCESS" or not isinstance(meta.get("result"), int):
            continue
        row = by_token.get(meta["result"])
        if row is None or row["task_id"] != task_id:
            report.succeeded_twice.append(f"{task_id}: SUCCESS token {meta['result']} never ran")
        elif row["slot"] is not None:
            won.setdefault((row["lock_name"], row["slot"]), set()).add(meta["result"])
    runs = {(row["lock_name"], row["slot"]): row for row in ledger}
    for (lock, slot), tokens in won.items():
        run = runs.get((lock, slot))
        if len(tokens) > 1 or run is None or {run["token"]} != tokens:
            ledger_says = (run["state"], run["token"]) if run else None
            report.succeeded_twice.append(
                f"{lock} {slot}: SUCCESS tokens {sorted(tokens)}, ledger {ledger_says}"
            )
    for run in ledger:
        if run["state"] != "succeeded" or run["reason"]:  # a TaskSkipped success has a reason
            continue
        ran = [row for row in executions if row["token"] == run["token"]]
        if len(ran) != 1 or not ran[0]["finished"]:
            report.succeeded_twice.append(
                f"{run['lock_name']} {run['slot']}: ledger token {run['token']} has {ran}"
            )


def _check_resolved(
    report: Report,
    *,
    sent: list[Sent],
    ledger: list[dict[str, Any]],
    sends: list[dict[str, Any]],
    skips: list[dict[str, Any]],
    metas: dict[str, dict[str, Any]],
) -> None:
    runs = {(row["lock_name"], row["slot"]): row for row in ledger}
    # A slot whose every message was skipped and that beat did not send (so no row) never
    # ran: the skip log says why. A beat-sent one is recorded `skipped`.
    skipped = {(row["lock_name"], row["slot"]) for row in skips if row["reason"]}
    for message in sent:
        meta = metas.get(message.result.id) or {}
        state = meta.get("status", "PENDING")
        if state not in FINAL_STATES:
            report.unsettled.append(f"{message.lock} {message.slot} {message.result.id}: {state}")
        elif state == "FAILURE" and not (meta.get("result") or {}).get("exc_message"):
            report.unsettled.append(f"{message.lock} {message.slot}: FAILURE without an error")
        elif state == "SKIPPED" and not (meta.get("result") or {}).get("reason"):
            report.unsettled.append(f"{message.lock} {message.slot}: SKIPPED without a reason")
    # A message refused before it could claim (bad input, wrong setup) failed loudly: its
    # result holds the error. Its slot is resolved if every message of it was refused.
    refused = {
        (m.lock, m.slot)
        for m in sent
        if (metas.get(m.result.id) or {}).get("status") == "FAILURE"
        and (m.lock, m.slot) not in runs
    }
    wanted = {(m.lock, m.slot) for m in sent if m.slot is not None} - refused
    wanted |= set(runs)
    for send in sends:
        if send["sent_at"] is None:
            report.unresolved.append(f"beat claim {send['entry']} {send['slot']} never sent")
        wanted.add((send["lock_name"], send["slot"]))
    for lock, slot in sorted(wanted):
        run = runs.get((lock, slot))
        if (lock, slot) in skipped and run is None:
            continue
        if run is None:
            report.unresolved.append(f"{lock} {slot}: no ledger row")
        elif run["state"] in ("failed", "skipped") and not run["reason"]:
            report.unresolved.append(f"{lock} {slot}: {run['state']} without a reason")
        elif run["state"] not in ("succeeded", "failed", "skipped"):
            report.unresolved.append(f"{lock} {slot}: left {run['state']} (token {run['token']})")


def held_locks(dsn: str, names: Iterable[str]) -> list[str]:
    """Which of the locks ``names`` some session still holds or waits for."""
    by_key = {lock_key(name): name for name in names}
    pairs = [split_key(key) for key in by_key]
    query = """
        SELECT (classid::bigint << 32) | objid::bigint AS key, pid, granted FROM pg_locks
         WHERE locktype = 'advisory' AND objsubid = 1
           AND (classid::bigint, objid::bigint)
               IN (SELECT * FROM unnest(%s::bigint[], %s::bigint[]))
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(query, ([c for c, _ in pairs], [o for _, o in pairs])).fetchall()
    return [
        f"{by_key.get(key, key)} by backend {pid} (granted {granted})" for key, pid, granted in rows
    ]


def held_rows(dsn: str, schema: str, names: Iterable[str], timeout: float) -> list[str]:
    """Which of the locks ``names`` a row still holds (the rows lock backend), once a
    holder killed before the stop had time to let its lease run out."""
    query = sql.SQL(
        "SELECT lock_name, token, task_id FROM {} WHERE expires_at > now() "
        "AND lock_name = ANY(%s) ORDER BY lock_name"
    ).format(sql.Identifier(schema, "pglock_row_locks"))

    def held() -> list[str]:
        with psycopg.connect(dsn, autocommit=True) as conn:
            try:
                rows = conn.execute(query, (sorted(names),)).fetchall()
            except psycopg.errors.UndefinedTable:  # the schema was never created
                return []
        return [f"{name} by the row of token {token} (task {task})" for name, token, task in rows]

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not held(), timeout=timeout, interval=0.2, message="rows to expire")
    return held()


def open_sessions(dsn: str, pids: set[int], timeout: float = GONE_TIMEOUT) -> list[str]:
    """Sessions our processes (``pids``) still have, once the server had time to end them."""

    def ours() -> list[str]:
        query = """
            SELECT pid, application_name, state FROM pg_stat_activity
             WHERE datname = current_database()
               AND (application_name LIKE 'celery-pglock%%' OR application_name LIKE 'pglock %%')
        """
        with psycopg.connect(dsn, autocommit=True) as conn:
            rows = conn.execute(query).fetchall()
        return [
            f"backend {backend}: {name!r} ({state})"
            for backend, name, state in rows
            if session_pid(name) in pids
        ]

    with contextlib.suppress(AssertionError):
        wait_until(lambda: not ours(), timeout=timeout, interval=0.1, message="sessions to end")
    return ours()


def session_pid(application_name: str | None) -> int | None:
    """The client pid a celery-pglock session's ``application_name`` names, if it is one."""
    match = _OUR_SESSION.match(application_name or "")
    return int(match.group(1) or match.group(2)) if match else None


def log_time(line: str) -> float:
    """Epoch seconds of a Celery log line (``[2026-11-29 19:45:47,241: …``, local time)."""
    stamp = line.lstrip("[").split(": ", 1)[0]
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").astimezone().timestamp()


def _lockable(name: str) -> bool:
    """Whether ``name`` is a valid lock name (bad-input tests send invalid ones)."""
    try:
        lock_key(name)
    except ValueError:
        return False
    return True
