"""Skips and lock changes reach monitoring: events, signals, metrics and log levels.

- ``task-skipped`` events from a real ``celery worker -E`` reach a real event receiver
  (what ``celery events`` and Flower use) on Redis, and ``events.State`` shows SKIPPED;
- the four signals fire with their documented arguments (in-process worker, Redis);
- ``pglock_metrics = True`` counts acquisitions, skips, waits, holds, losses and leader
  changes; off, it does not even import ``prometheus_client``;
- a database outage is one ERROR line, then WARNINGs, then one INFO when it ends.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from celery.events.state import State

from celery_pglock import PgLockTask, ops, signals
from celery_pglock import _task as task_module
from celery_pglock._config import Settings
from celery_pglock._keys import leader_lock_name, lock_key
from celery_pglock._outage import OutageLog
from celery_pglock._states import SKIPPED
from celery_pglock.beat._leader import LeaderElection
from celery_pglock.errors import DatabaseUnavailable
from celery_pglock.schema import Tables
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import close_all
from celery_pglock.store.statements import OnConnection
from tests.apps import testapp
from tests.apps.harness import app_env, configure_client
from tests.fixtures.procs import Procs, wait_until
from tests.fixtures.proxy import ProxyFactory
from tests.integration.test_ops import start_holder

pytestmark = [
    pytest.mark.acceptance,
    # Celery's Redis result backend calls setex, deprecated in redis-py 8: in-process
    # workers would otherwise fail to store results under filterwarnings = error.
    pytest.mark.filterwarnings("ignore:Call to deprecated setex:DeprecationWarning"),
]

SLOT = "2026-11-29T03:00:00Z"
RESULT_TIMEOUT = 20.0


# -- task-skipped events from a real worker ------------------------------------------------


@dataclass
class EventLog:
    """Events captured by a real ``app.events.Receiver`` running in a thread."""

    app: Celery
    events: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.receiver: Any = None
        self.thread = threading.Thread(target=self._capture, daemon=True)

    def _capture(self) -> None:
        with self.app.connection_for_read() as conn:
            self.receiver = self.app.events.Receiver(conn, handlers={"*": self.events.append})
            self.receiver.capture(limit=None, timeout=None, wakeup=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.receiver is not None:
            self.receiver.should_stop = True
        self.thread.join(timeout=5)

    def of(self, kind: str, **fields: Any) -> list[dict[str, Any]]:
        return [
            event
            for event in list(self.events)
            if event["type"] == kind and all(event.get(k) == v for k, v in fields.items())
        ]


@dataclass
class EventWorker:
    """A real `celery worker -E` on the shared test app, and what it emits."""

    app: Celery
    log: EventLog
    schema: str
    dsn: str

    @property
    def lock_name(self) -> str:
        return f"{self.schema}:testapp.work"

    def send(self, slot: str = SLOT) -> Any:
        return testapp.work.apply_async(headers={"pglock_slot": slot})

    def skipped_event(self, task_id: str) -> dict[str, Any]:
        found = wait_until(
            lambda: self.log.of("task-skipped", uuid=task_id),
            timeout=RESULT_TIMEOUT,
            message=f"a task-skipped event for {task_id}",
        )
        return found[0]  # type: ignore[no-any-return]


@pytest.fixture
def event_worker(
    procs: Procs, pg_dsn: str, pglock_schema: str, redis_url: str
) -> Iterator[EventWorker]:
    """A worker with task events on (-E), and a receiver that already hears it."""
    env = app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        broker_url=redis_url,
        backend_url=redis_url,
        TEST_NAMESPACE=pglock_schema,
    )
    client = configure_client(env)
    hostname = f"ev-{uuid.uuid4().hex[:8]}@{HOSTNAME}"
    args = ("-E", "-l", "info", "-P", "prefork", "-c", "1", "-n", hostname, "-Q", env["TEST_QUEUE"])
    worker = procs.celery(
        "tests.apps.testapp", "worker", *args, "--without-gossip", "--without-mingle", env=env
    )
    worker.wait_for_log("ready.", timeout=30)
    log = EventLog(client)
    log.start()
    try:
        # Redis events are pub/sub: only a subscribed receiver hears them. A heartbeat from
        # our worker proves the subscription is live before the test sends anything.
        wait_until(lambda: log.of("worker-heartbeat", hostname=hostname), timeout=15)
        yield EventWorker(client, log, pglock_schema, pg_dsn)
    finally:
        log.stop()


def test_duplicate_after_success_emits_task_skipped_event(event_worker: EventWorker) -> None:
    """A duplicate of a done slot reaches `celery events` as task-skipped (reason done)."""
    first = event_worker.send()
    first.get(timeout=RESULT_TIMEOUT)
    duplicate = event_worker.send()

    event = event_worker.skipped_event(duplicate.id)

    expected = {"reason": "done", "lock": event_worker.lock_name, "slot": SLOT}
    assert expected == {key: event[key] for key in expected}
    assert first.id == event["holder"]["task_id"]
    state = State()
    for captured in [*event_worker.log.of("task-received", uuid=duplicate.id), event]:
        state.event(captured)
    assert SKIPPED == state.tasks[duplicate.id].state
    assert "done" == state.tasks[duplicate.id].reason
    assert "done" == duplicate.get(timeout=RESULT_TIMEOUT)["reason"]
    assert SKIPPED == duplicate.state


def test_locked_skip_event_names_the_holder(event_worker: EventWorker, procs: Procs) -> None:
    """A message skipped because the lock is held says who holds it, in the event."""
    holder = start_holder(
        procs, event_worker.dsn, event_worker.schema, event_worker.lock_name, task_id="t-holder"
    )

    skipped = event_worker.send("2026-11-30T03:00:00Z")
    event = event_worker.skipped_event(skipped.id)

    assert "locked" == event["reason"]
    who = event["holder"]
    assert ("t-holder", holder.proc.pid, HOSTNAME) == (who["task_id"], who["pid"], who["host"])
    assert who["since"] is not None


# -- signals -------------------------------------------------------------------------------


@dataclass
class Received:
    """Every call of the connected signals, as (signal name, sender, kwargs)."""

    calls: list[tuple[str, Any, dict[str, Any]]] = field(default_factory=list)

    def receiver(self, name: str) -> Any:
        def receive(sender: Any = None, **kwargs: Any) -> None:
            kwargs.pop("signal", None)
            self.calls.append((name, sender, kwargs))

        return receive

    def of(self, name: str) -> list[tuple[Any, dict[str, Any]]]:
        return [(sender, kwargs) for kind, sender, kwargs in list(self.calls) if kind == name]


@pytest.fixture
def received() -> Iterator[Received]:
    log = Received()
    pairs = [
        (signals.lock_acquired, log.receiver("lock_acquired")),
        (signals.task_skipped, log.receiver("task_skipped")),
        (signals.lock_lost, log.receiver("lock_lost")),
        (signals.beat_leader_changed, log.receiver("beat_leader_changed")),
    ]
    for signal, receiver in pairs:
        signal.connect(receiver, weak=False)
    try:
        yield log
    finally:
        for signal, receiver in pairs:
            signal.disconnect(receiver)


GATE = threading.Event()  # holds the in-process task body until the test opens it


def locked_app(dsn: str, schema: str, redis_url: str, **conf: Any) -> Celery:
    """An in-process app: one locked task that waits for GATE. A 10 s lease: a lost lock
    here comes from the operator's release, never from a heartbeat late on a busy machine
    (with 1 s, a loaded run's holder lost it by its lease before the release)."""
    app = Celery("sigapp", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        result_backend=redis_url,
        task_default_queue=f"q-{uuid.uuid4().hex[:10]}",
        pglock_dsn=dsn,
        pglock_schema=schema,
        pglock_namespace=schema,
        pglock_lease=10.0,
        **conf,
    )

    @app.task(base=PgLockTask, name="sigapp.gated", shared=False)
    def gated(wait: bool = False) -> str:
        if wait:
            GATE.wait(RESULT_TIMEOUT)
        return "ran"

    return app


@pytest.fixture
def gate() -> Iterator[threading.Event]:
    GATE.clear()
    try:
        yield GATE
    finally:
        GATE.set()
        close_all()  # the in-process worker's pool


def test_signals_fire_for_acquire_skip_and_lost_lock(
    received: Received,
    gate: threading.Event,
    pg_dsn: str,
    pglock_schema: str,
    redis_url: str,
) -> None:
    """lock_acquired, task_skipped and lock_lost fire with lock, slot, token, reason, cause."""
    app = locked_app(pg_dsn, pglock_schema, redis_url)
    task = app.tasks["sigapp.gated"]
    name = f"{pglock_schema}:sigapp.gated"
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False):
        running = task.apply_async((True,), headers={"pglock_slot": SLOT})
        wait_until(lambda: received.of("lock_acquired"), timeout=RESULT_TIMEOUT)
        duplicate = task.apply_async((False,), headers={"pglock_slot": SLOT})
        assert "locked" == duplicate.get(timeout=RESULT_TIMEOUT)["reason"]
        assert SKIPPED == duplicate.state
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            assert ops.force_release(OnConnection(conn, Tables(pglock_schema)), name) is not None
        wait_until(lambda: received.of("lock_lost"), timeout=RESULT_TIMEOUT)
        gate.set()
        assert "ran" == running.get(timeout=RESULT_TIMEOUT)

    [(sender, acquired)] = received.of("lock_acquired")
    assert sender is task
    assert (name, SLOT) == (acquired["lock"], acquired["slot"])
    [(sender, skip)] = received.of("task_skipped")
    assert (sender, skip["reason"]) == (task, "locked")
    meta = skip["meta"]
    assert (running.id, acquired["token"]) == (meta["holder"]["task_id"], meta["token"])
    [(_, lost)] = received.of("lock_lost")
    assert (name, SLOT, acquired["token"]) == (lost["lock"], lost["slot"], lost["token"])
    assert "terminat" in lost["cause"]


def test_beat_leader_changed_fires_on_election_and_step_down(
    received: Received, pg_dsn: str, pglock_schema: str
) -> None:
    """beat_leader_changed says leader=True when elected, False when the lease is lost."""
    name = leader_lock_name(pglock_schema)
    election = LeaderElection(
        Settings(dsn=pg_dsn, schema=pglock_schema), lock_name=name, key=lock_key(name), lease=1.0
    )
    election.start()
    try:
        wait_until(election.is_leader, message="leadership")
        leader = election.connection
        assert leader is not None
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (leader.info.backend_pid,))
        wait_until(lambda: not election.is_leader(), message="the step-down")
        wait_until(election.is_leader, message="re-election")
    finally:
        election.close()

    changes = [(s, kw["leader"], kw["previous"]) for s, kw in received.of("beat_leader_changed")]
    assert [(election, True, False), (election, False, True), (election, True, False)] == changes


# -- metrics ---------------------------------------------------------------------------------


def sample(name: str, **labels: str) -> float:
    from prometheus_client import REGISTRY  # noqa: PLC0415 - optional extra

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_metrics_count_acquisitions_skips_waits_holds_and_losses(
    gate: threading.Event, pg_dsn: str, pglock_schema: str, redis_url: str
) -> None:
    """With pglock_metrics on, a run and a skipped duplicate show in the Prometheus metrics."""
    pytest.importorskip("prometheus_client")
    app = locked_app(pg_dsn, pglock_schema, redis_url, pglock_metrics=True)
    task = app.tasks["sigapp.gated"]
    labels = {"task": "sigapp.gated"}
    names = (
        "pglock_lock_acquisitions_total",
        "pglock_lock_wait_seconds_count",
        "pglock_lock_hold_seconds_count",
    )
    before = {name: sample(name, **labels) for name in names}
    skips_before = sample("pglock_task_skips_total", reason="done", **labels)
    gate.set()

    with start_worker(app, pool="threads", perform_ping_check=False):
        task.apply_async(headers={"pglock_slot": SLOT}).get(timeout=RESULT_TIMEOUT)
        duplicate = task.apply_async(headers={"pglock_slot": SLOT})
        assert "done" == duplicate.get(timeout=RESULT_TIMEOUT)["reason"]
        # task_postrun (hold time) runs after the result is stored: poll for it.
        wait_until(lambda: sample(names[2], **labels) > before[names[2]], timeout=5)

    assert {name: before[name] + 1 for name in names} == {
        name: sample(name, **labels) for name in names
    }
    assert skips_before + 1 == sample("pglock_task_skips_total", reason="done", **labels)


METRICS_OFF_CODE = """
import sys
import celery_pglock.metrics as metrics
from celery import Celery, signals

class Worker:
    def __init__(self, app):
        self.app = app

app = Celery("off")
signals.worker_init.send(sender=Worker(app))
assert metrics._installed is None, "installed while pglock_metrics is off"
assert "prometheus_client" not in sys.modules, "prometheus_client imported while off"
app.conf.pglock_metrics = True
signals.worker_init.send(sender=Worker(app))
assert metrics._installed is not None, "not installed with pglock_metrics = True"
print("ok")
"""


def test_metrics_show_each_watched_entry_s_freshness() -> None:
    """The beat leader's look at an entry with pglock_overdue_after sets its two gauges."""
    pytest.importorskip("prometheus_client")
    from celery_pglock import metrics  # noqa: PLC0415 - installed on demand

    metrics.install()
    done_at = datetime(2026, 12, 1, 2, 0, 5, tzinfo=timezone.utc)

    stamp = "pglock_entry_last_success_timestamp_seconds"

    signals.entry_freshness.send(
        sender=None, entry="nightly", last_success_at=done_at, overdue=True
    )
    late = (sample("pglock_entry_overdue", entry="nightly"), sample(stamp, entry="nightly"))
    signals.entry_freshness.send(sender=None, entry="nightly", last_success_at=None, overdue=False)

    assert (1.0, done_at.timestamp()) == late
    assert (0.0, done_at.timestamp()) == (
        sample("pglock_entry_overdue", entry="nightly"),
        sample(stamp, entry="nightly"),
    )


def test_metrics_count_the_slot_less_messages_of_scheduled_tasks() -> None:
    """Each message a stock beat sends for a task a PgLockScheduler sends is counted."""
    pytest.importorskip("prometheus_client")
    from celery_pglock import metrics  # noqa: PLC0415 - installed on demand

    metrics.install()
    task = testapp.app.tasks["testapp.tick"]
    before = sample("pglock_rogue_messages_total", task="testapp.tick")

    signals.rogue_message.send(sender=task, origin="gen1@stock-beat-host")

    assert before + 1 == sample("pglock_rogue_messages_total", task="testapp.tick")


def test_metrics_cost_nothing_unless_enabled() -> None:
    """With pglock_metrics off, worker start connects nothing and imports no prometheus."""
    pytest.importorskip("prometheus_client")
    done = subprocess.run(
        [sys.executable, "-c", METRICS_OFF_CODE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    assert (0, "ok") == (done.returncode, done.stdout.strip()), done.stderr


# -- log levels during a database outage -----------------------------------------------------


def test_database_outage_logs_one_error_then_warnings_then_recovery(
    tcp_proxy: ProxyFactory,
    pg_dsn: str,
    pglock_schema: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first task to hit an outage logs ERROR, later ones WARNING; recovery says INFO."""
    monkeypatch.setattr(task_module, "_outage", OutageLog(task_module.logger, "pglock_db_back"))
    proxy = tcp_proxy.for_dsn(pg_dsn)
    app = Celery("outage", set_as_current=False)
    app.conf.update(
        pglock_dsn=proxy.proxied_dsn(pg_dsn),
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
        pglock_connect_timeout=1,
    )

    @app.task(base=PgLockTask, name="outage.job", shared=False)
    def job() -> str:
        return "ran"

    proxy.blackhole()  # a partition: connections time out
    try:
        with caplog.at_level(logging.INFO, logger="celery_pglock"):
            failed = [job.apply(), job.apply()]
            proxy.restore()
            recovered = job.apply()
    finally:
        close_all()

    assert all(isinstance(result.result, DatabaseUnavailable) for result in failed)
    assert "ran" == recovered.result
    outage = [
        (record.levelname, record.action)  # type: ignore[attr-defined]
        for record in caplog.records
        if getattr(record, "action", "").startswith("pglock_db_")
    ]
    expected = [
        ("ERROR", "pglock_db_error_fail"),
        ("WARNING", "pglock_db_error_fail"),
        ("INFO", "pglock_db_back"),
    ]
    assert expected == outage
