"""Beat scenarios for the acceptance tests: real ``celery beat`` replicas feeding workers.

A scenario is a set of processes (beat replicas, workers) on its own schema, queue and
lock namespace, ticking one interval entry every second. Scenarios need tens of slots, so
the ``beat_lab`` fixture starts every scenario the selected tests use at once, on first
use, and each test waits only for what its own scenario still lacks: the tier runs in
about the time of its longest scenario rather than their sum.

A test picks its scenario by indirect parametrization::

    @pytest.mark.parametrize("scenario", ["leader"], indirect=True)
    def test_x(scenario: Scenario) -> None: ...

Processes stop after the last selected test of their scenario. While a test runs, its
scenario's processes are lent to the ``procs`` fixture, so a failed test's report carries
their logs.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock.schema import Tables
from celery_pglock.store._migrations import ensure_schema
from tests.apps import testapp
from tests.apps.harness import app_env
from tests.faults.pgbouncer import PgBouncer
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import STOP_TIMEOUT, Proc, Procs, wait_until

T = TypeVar("T")

APP = "tests.apps.testapp"
TICK = "testapp.tick"
SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
LOG_TIME_FORMAT = "%Y-%m-%d %H:%M:%S,%f"
HOSTNAME = socket.gethostname()
START_TIMEOUT = 60.0  # seconds for a scenario's first execution (many processes start)
SLOT_TIMEOUT = 90.0  # seconds for a scenario to reach the slots a test asks for
DJANGO_SCHEDULER = "tests.apps.django_proj.scheduler:PgLockDatabaseScheduler"


@dataclass(frozen=True)
class Spec:
    """What a scenario runs."""

    beats: int = 3
    leader: bool = True
    lease: float = 5.0
    broker: str = "redis"  # "redis" or "rabbitmq"
    workers: int = 1
    stock_beats: int = 0
    django: bool = False
    task: str = TICK
    # Every process through PgBouncer in transaction pooling: locks and the leader on rows.
    pooled: bool = False


SPECS: dict[str, Spec] = {
    "leader": Spec(),
    "active": Spec(leader=False),
    "kill": Spec(),
    "freeze": Spec(lease=2.0),
    "kill-pooled": Spec(pooled=True),
    "freeze-pooled": Spec(lease=2.0, pooled=True),
    "mixed": Spec(beats=2, stock_beats=1, workers=2, task="testapp.slow_tick"),
    "django": Spec(beats=2, django=True),
    "rabbitmq": Spec(broker="rabbitmq"),
}
"""Every scenario, by the name tests parametrize ``scenario`` with."""


@dataclass(frozen=True)
class Send:
    """One row of the beat sends table: who claimed which slot, and when."""

    entry: str
    slot: str
    sent_by: str
    sends: int
    claimed_at: datetime
    sent_at: datetime | None

    @property
    def pid(self) -> int:
        return int(self.sent_by.rsplit(":", 1)[1])

    @property
    def lateness(self) -> float:
        """Seconds from the slot's due time to its claim."""
        return self.claimed_at.timestamp() - slot_epoch(self.slot)


@dataclass
class Scenario:
    """A running scenario: its processes, and views of what they did."""

    name: str
    spec: Spec
    dsn: str
    env: dict[str, str]
    procs: Procs
    beats: list[Proc] = field(default_factory=list)
    stock: list[Proc] = field(default_factory=list)
    workers: list[Proc] = field(default_factory=list)
    bouncer: PgBouncer | None = None  # spec.pooled: the PgBouncer every process goes through
    remaining_tests: int = 0
    _once: dict[str, Any] = field(default_factory=dict)

    @property
    def schema(self) -> str:
        return self.env["TEST_SCHEMA"]

    @property
    def namespace(self) -> str:
        return self.env["TEST_NAMESPACE"]

    def once(self, key: str, action: Callable[[], T]) -> T:
        """Run ``action`` the first time a test asks (e.g. a fault), then reuse its result.

        If it failed, the later tests fail with the same error rather than injecting the
        fault again into a scenario in an unknown state.
        """
        if key not in self._once:
            try:
                self._once[key] = action()
            except Exception as exc:
                self._once[key] = exc
                raise
        result = self._once[key]
        if isinstance(result, Exception):
            raise result
        found: T = result
        return found

    def executions(self) -> list[dict[str, Any]]:
        """Every execution of the entry's task, oldest first."""
        return self._query(
            "SELECT * FROM {} WHERE task = %(task)s ORDER BY id",
            "executions",
            {"task": self.spec.task},
        )

    def sends(self) -> list[Send]:
        """Every slot claimed by a pglock beat replica, in slot order."""
        rows = self._query(
            "SELECT entry, slot, sent_by, sends, claimed_at, sent_at FROM {} "
            "WHERE namespace = %(namespace)s ORDER BY slot",
            "pglock_beat_sends",
            {"namespace": self.namespace},
        )
        return [Send(**row) for row in rows]

    def skips(self) -> list[dict[str, Any]]:
        """Every skipped message, oldest first."""
        return self._query("SELECT * FROM {} ORDER BY id", "pglock_skips", {})

    def executed_slots(self) -> list[str]:
        """Slots of the slotted executions, in execution order (duplicates kept)."""
        return [row["slot"] for row in self.executions() if row["slot"] is not None]

    def wait_slots(self, count: int, *, after: float = 0.0, timeout: float = SLOT_TIMEOUT) -> None:
        """Wait until ``count`` distinct slots due after ``after`` (epoch s) have executed."""

        def enough() -> bool:
            self.check_alive()
            due = {s for s in self.executed_slots() if slot_epoch(s) > after}
            return len(due) >= count

        wait_until(enough, timeout=timeout, interval=0.2, message=f"{count} slots ({self.name})")

    def proc_of(self, send: Send) -> Proc:
        """The beat replica that made a claim."""
        assert send.sent_by.startswith(f"{HOSTNAME}:"), send
        found = [proc for proc in self.beats if proc.pid == send.pid]
        assert found, f"{send.sent_by} is none of {self.beats}"
        return found[0]

    def leader(self) -> Proc:
        """The replica that claimed the latest slot (in leader mode: the leader)."""
        latest = max(self.sends(), key=lambda send: send.claimed_at)
        return self.proc_of(latest)

    def check_alive(self) -> None:
        """Fail at once, with its log, if a process died that nobody killed."""
        for proc in [*self.workers, *self.beats, *self.stock]:
            if proc.returncode not in (None, -9):  # -9: SIGKILLed by the test
                raise AssertionError(f"{proc!r} exited:\n{proc.log_tail()}")

    def _query(self, text: str, table: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        query = sql.SQL(text).format(sql.Identifier(self.schema, table))
        with (
            psycopg.connect(self.dsn, autocommit=True) as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return cur.execute(query, params).fetchall()


def slot_epoch(slot: str) -> int:
    """Epoch seconds of a slot id."""
    return int(datetime.strptime(slot, SLOT_FORMAT).replace(tzinfo=timezone.utc).timestamp())


def promoted_at(proc: Proc) -> float:
    """Epoch seconds of the last "is now the leader" line in a replica's log."""
    lines = [line for line in proc.log_text().splitlines() if "is now the leader" in line]
    assert lines, f"{proc!r} never led"
    stamp = lines[-1].lstrip("[").split(": ", 1)[0]  # "2026-11-29 19:45:47,241" (local time)
    return datetime.strptime(stamp, LOG_TIME_FORMAT).astimezone().timestamp()


def missing_slots(slots: list[str]) -> list[int]:
    """Epoch seconds of the 1-s slots absent between the first and the last of ``slots``."""
    seconds = sorted({slot_epoch(slot) for slot in slots})
    if not seconds:
        return []
    present = set(seconds)
    return [s for s in range(seconds[0], seconds[-1] + 1) if s not in present]


def duplicates(slots: list[str]) -> dict[str, int]:
    """Slots that occur more than once, with their count."""
    counts: dict[str, int] = {}
    for slot in slots:
        counts[slot] = counts.get(slot, 0) + 1
    return {slot: n for slot, n in counts.items() if n > 1}


class BeatLab:
    """Starts scenarios (all those the session's tests use, together) and stops them."""

    def __init__(self, request: pytest.FixtureRequest, dsn: str, root: Path) -> None:
        self.request = request
        self.dsn = dsn
        self.root = root
        self.scenarios: dict[str, Scenario] = {}
        self.unavailable: dict[str, BaseException] = {}

    def start_all(self, names: dict[str, int]) -> None:
        """Start the named scenarios (name -> how many tests use it).

        A scenario that cannot start fails (or skips) only its own tests.
        """
        for name, tests in names.items():
            try:
                scenario = self._start(name)
            except (pytest.skip.Exception, pytest.fail.Exception, Exception) as exc:
                self.unavailable[name] = exc  # raised again by each test of that scenario
                continue
            scenario.remaining_tests = tests
        started = [self.scenarios[n] for n in names if n not in self.unavailable]
        for scenario in started:
            try:
                wait_until(
                    lambda s=scenario: s.check_alive() or s.executions(),  # type: ignore[misc]
                    timeout=START_TIMEOUT,
                    interval=0.2,
                    message=f"a first execution in scenario {scenario.name}",
                )
            except AssertionError as exc:
                self.unavailable[scenario.name] = exc
                stop_together(scenario.procs)

    def get(self, name: str) -> Scenario:
        if name in self.unavailable:
            raise self.unavailable[name]
        if name not in self.scenarios:  # a test not seen at collection (e.g. rerun)
            self.start_all({name: 1})
        return self.scenarios[name]

    def finished(self, scenario: Scenario) -> None:
        scenario.remaining_tests -= 1
        if scenario.remaining_tests <= 0:
            stop_together(scenario.procs)

    def close(self) -> None:
        """Stop every process and drop every schema (once; later calls do nothing)."""
        scenarios, self.scenarios = self.scenarios, {}
        for scenario in scenarios.values():
            with contextlib.suppress(Exception):
                stop_together(scenario.procs)
            if scenario.bouncer is not None:
                scenario.bouncer.stop()
            drop_schema(self.dsn, scenario.schema)

    def _start(self, name: str) -> Scenario:
        spec = SPECS[name]
        if spec.django:
            pytest.importorskip("django_celery_beat", reason="needs django-celery-beat")
        broker = self.request.getfixturevalue("redis_url" if spec.broker == "redis" else "amqp_url")
        schema = f"t_{uuid.uuid4().hex[:12]}"
        env = app_env(
            pg_dsn=self.dsn,
            schema=schema,
            broker_url=broker,
            TEST_NAMESPACE=f"{name}-{uuid.uuid4().hex[:8]}",
            TEST_BEAT_LEADER="1" if spec.leader else "0",
            TEST_BEAT_LEASE=spec.lease,
            TEST_BEAT_TASK=spec.task,
        )
        if not spec.django:
            env["TEST_BEAT_EVERY"] = "1"
        log_dir = self.root / name
        log_dir.mkdir()
        scenario = Scenario(name, spec, self.dsn, env, Procs(log_dir, cwd=Path.cwd()))
        self.scenarios[name] = scenario  # from here on, close() drops its schema
        if spec.pooled:
            scenario.bouncer = PgBouncer(self.dsn, log_dir / "pgbouncer.log")
            env["PGLOCK_DSN"] = scenario.bouncer.dsn_for("tx")
        prepare_schema(self.dsn, schema)
        if spec.django:
            migrate_django(env, log_dir)
        self._launch(scenario)
        return scenario

    def _launch(self, scenario: Scenario) -> None:
        spec, env, procs = scenario.spec, scenario.env, scenario.procs
        for n in range(spec.workers):
            scenario.workers.append(
                procs.celery(
                    APP,
                    "worker",
                    "--pool=solo",
                    "--loglevel=INFO",
                    # Unique: on RabbitMQ each node name's pidbox queue is exclusive.
                    f"--hostname=w{n}-{scenario.namespace}@%h",
                    "--without-mingle",
                    "--without-gossip",
                    "--without-heartbeat",
                    env=env,
                    name=f"worker{n}",
                )
            )
        extra = ["--scheduler", DJANGO_SCHEDULER] if spec.django else []
        for n in range(spec.beats):
            scenario.beats.append(
                procs.celery(APP, "beat", "--loglevel=INFO", *extra, env=env, name=f"beat{n}")
            )
        for n in range(spec.stock_beats):
            shelve = procs.log_dir / f"stock{n}-schedule"
            stock_env = {**env, "TEST_BEAT_SCHEDULER": "celery.beat:PersistentScheduler"}
            scenario.stock.append(
                procs.celery(
                    APP,
                    "beat",
                    "--loglevel=INFO",
                    f"--schedule={shelve}",
                    env=stock_env,
                    name=f"stock{n}",
                )
            )


def stop_together(procs: Procs) -> None:
    """Stop every process at once, then wait for each (``Procs.stop_all`` goes one by one).

    Workers are SIGKILLed: the test is over, and a worker on AMQP only notices SIGTERM or
    SIGQUIT when its event loop's poll returns, up to 10 s later.
    """
    for proc in procs.started:
        if proc.alive:
            proc.thaw()
            sig = signal.SIGKILL if proc.name.startswith("worker") else signal.SIGTERM
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, sig)
    deadline = time.monotonic() + STOP_TIMEOUT
    for proc in procs.started:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(max(0.0, deadline - time.monotonic()))
    procs.stop_all()  # SIGKILLs what is left, and their children


@contextlib.contextmanager
def prepared_schema(dsn: str, prefix: str) -> Iterator[str]:
    """A new schema ``<prefix>_<random>`` prepared as ``prepare_schema`` does; dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    prepare_schema(dsn, name)
    try:
        yield name
    finally:
        drop_schema(dsn, name)


def prepare_schema(dsn: str, schema: str) -> None:
    """Create the schema with our tables and the ``executions`` table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
        ensure_schema(conn, Tables(schema), auto_migrate=True)
        executions = sql.Identifier(schema, "executions")
        conn.execute(sql.SQL(testapp.EXECUTIONS_SQL).format(executions=executions))


def migrate_django(env: dict[str, str], log_dir: Path) -> None:
    """Run Django's migrations and create the 1-s PeriodicTask, in a subprocess."""
    with (log_dir / "django-setup.log").open("wb") as log:
        subprocess.run(
            [sys.executable, "-m", "tests.apps.django_proj.setup_db"],
            env={**_base_env(), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=120,
        )


def _base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path.cwd())
    return env


def scenarios_of(session: pytest.Session) -> dict[str, int]:
    """Scenario name -> number of selected tests that use it."""
    counts: dict[str, int] = {}
    for item in session.items:
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("scenario") if callspec else None
        if isinstance(name, str) and name in SPECS:
            counts[name] = counts.get(name, 0) + 1
    return counts


@pytest.fixture(scope="session")
def beat_lab(
    request: pytest.FixtureRequest, pg_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[BeatLab]:
    """Every scenario the selected tests use, started together (under pytest-xdist, in the
    one worker that runs them all: ``tests/fixtures/sharing.py``)."""
    lab = BeatLab(request, pg_dsn, tmp_path_factory.mktemp("beat"))
    try:
        lab.start_all(scenarios_of(request.session))
        yield lab
    finally:
        lab.close()


@pytest.fixture
def scenario(request: pytest.FixtureRequest, beat_lab: BeatLab, procs: Procs) -> Iterator[Scenario]:
    """The scenario named by the test's parameter, running."""
    found = beat_lab.get(request.param)
    procs.started.extend(found.procs.started)  # a failed test's report shows their logs
    try:
        yield found
    finally:
        lent = set(map(id, found.procs.started))  # they are not the test's to stop
        procs.started[:] = [proc for proc in procs.started if id(proc) not in lent]
        beat_lab.finished(found)
