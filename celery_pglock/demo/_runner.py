"""One demo run: start the fleet, let it work for ``duration``, inject faults, drain, stop.

The measuring window opens once every process is ready and closes ``duration`` seconds
later; beats keep going for a moment after it (so each slot of the window is sent), then
stop, and the workers finish what was sent before they are stopped too.
"""

from __future__ import annotations

import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery

from celery_pglock._dsn import redact
from celery_pglock.demo import _schedule as schedule
from celery_pglock.demo._chaos import Chaos, Event, Redeliverer
from celery_pglock.demo._facts import Facts, Reader
from celery_pglock.demo._processes import Fleet
from celery_pglock.demo._progress import Display, Snapshot
from celery_pglock.demo._server import prepare_broker

TICK = 0.25
READY_TIMEOUT = 60.0
BEAT_GRACE = 1.5  # beats outlive the window by this much, so its last slot is sent
SETTLE = 1.0  # the fleet must be idle this long before the drain ends
DRAIN_TIMEOUT = max(task.runs_for for task in schedule.TASKS) + 8.0


@dataclass(frozen=True)
class RunSpec:
    """What one run does."""

    locked: bool
    beats: int
    workers: int
    duration: float
    concurrency: int
    chaos: bool = False
    redeliver_every: float = 0.0

    @property
    def mode(self) -> str:
        return "lock" if self.locked else "stock"


@dataclass(frozen=True)
class Place:
    """Where a run keeps its data, messages and logs."""

    dsn: str
    schema: str
    broker: str | None
    log_dir: Path


@dataclass
class RunRecord:
    """What the report needs about a finished run."""

    spec: RunSpec
    run_id: str
    broker: str
    log_dir: Path
    start: float = 0.0
    end: float = 0.0
    facts: Facts = field(default_factory=lambda: Facts([], [], []))
    events: list[Event] = field(default_factory=list)
    redelivered: list[tuple[str, str]] = field(default_factory=list)


def run(place: Place, spec: RunSpec, rng: random.Random, display: Display) -> RunRecord:
    """Run the fleet for ``spec.duration`` seconds and read back what happened."""
    run_id = uuid.uuid4().hex[:8]
    broker = place.broker or _postgres_broker(place)
    log_dir = place.log_dir / f"{spec.mode}-{run_id}"
    log_dir.mkdir(parents=True)
    shown = "PostgreSQL" if place.broker is None else redact(broker)
    record = RunRecord(spec, run_id, shown, log_dir)
    if place.broker is None:
        prepare_broker(broker, schedule.queue(run_id))
    reader = Reader(place.dsn, place.schema, run_id, schedule.namespace(run_id))
    try:
        env = _env(place, spec, run_id, broker)
        _operate(record, Fleet(log_dir, env, concurrency=spec.concurrency), reader, rng, display)
        record.facts = reader.facts()
    finally:
        reader.close()
    return record


def _operate(
    record: RunRecord, fleet: Fleet, reader: Reader, rng: random.Random, display: Display
) -> None:
    """Start, work, drain; every process is stopped on the way out, whatever happens."""
    client = Celery("pglock_demo_client", broker=_fleet_broker(fleet), set_as_current=False)
    try:
        _start(fleet, record.spec, display)
        _work(record, fleet=fleet, reader=reader, client=client, rng=rng, display=display)
        display.note("stopping beats; workers finish what was sent")
        fleet.stop("beat")
        _drain(record, fleet, reader, client, display)
    finally:
        try:
            fleet.stop_all()
        finally:
            client.close()
            _dispose_broker_engines(_fleet_broker(fleet))


def _dispose_broker_engines(broker: str) -> None:
    """Close the PostgreSQL broker's pooled connections before the server may go away."""
    if broker.startswith(f"{schedule.BROKER_ALIAS}+"):
        from celery_pglock.demo._transport import dispose_engines  # noqa: PLC0415

        dispose_engines()


def _fleet_broker(fleet: Fleet) -> str:
    """The broker URL the fleet was given."""
    return fleet.env[schedule.ENV_BROKER]


def _postgres_broker(place: Place) -> str:
    from celery_pglock.demo._transport import broker_url  # noqa: PLC0415 - needs sqlalchemy

    return broker_url(place.dsn, place.schema)


def _env(place: Place, spec: RunSpec, run_id: str, broker: str) -> dict[str, str]:
    return {
        schedule.ENV_DSN: place.dsn,
        schedule.ENV_SCHEMA: place.schema,
        schedule.ENV_BROKER: broker,
        schedule.ENV_LOCK: "1" if spec.locked else "0",
        schedule.ENV_RUN: run_id,
    }


def _start(fleet: Fleet, spec: RunSpec, display: Display) -> None:
    procs = [fleet.start_worker() for _ in range(spec.workers)]
    procs += [fleet.start_beat(stock=not spec.locked) for _ in range(spec.beats)]
    display.note(f"started {spec.beats} beat(s) and {spec.workers} worker(s); waiting until ready")
    if spec.locked:  # the dashboard reads what PgLockScheduler and the ledger know
        web, url = fleet.start_web()
        procs.append(web)
        display.note(f"dashboard: {url} (while this run lasts)")
    started = time.time()

    def tick() -> None:
        elapsed = time.time() - started
        display.update(Snapshot("starting", elapsed, spec.duration, 0, 0, 0, 0))

    fleet.wait_ready(procs, READY_TIMEOUT, tick)


def _work(
    record: RunRecord,
    *,
    fleet: Fleet,
    reader: Reader,
    client: Celery,
    rng: random.Random,
    display: Display,
) -> None:
    spec = record.spec
    record.start = time.time()
    record.end = record.start + spec.duration
    chaos = Chaos(fleet, reader, rng, locked=spec.locked) if spec.chaos else None
    if chaos is not None:
        chaos.schedule(record.start, spec.duration)
    redeliverer = Redeliverer(client, reader, rng, spec.redeliver_every, after=record.start)
    queue = schedule.queue(record.run_id)
    while (now := time.time()) < record.end + BEAT_GRACE:
        if chaos is not None:
            display.note(chaos.step(now))
        if now < record.end:
            redeliverer.step(now, queue)
        display.update(_snapshot(record, reader, "running", now))
        time.sleep(TICK)
    record.events = chaos.events if chaos is not None else []
    record.redelivered = redeliverer.sent


def _drain(
    record: RunRecord, fleet: Fleet, reader: Reader, client: Celery, display: Display
) -> None:
    """Wait until nothing runs in a live worker and the queue is empty, for ``SETTLE`` s."""
    deadline = time.time() + DRAIN_TIMEOUT
    idle_since: float | None = None
    queue = schedule.queue(record.run_id)
    while (now := time.time()) < deadline:
        running = [pid for task in schedule.TASKS for pid in reader.running(task.name)]
        busy = any(fleet.owner_of(pid) for pid in running) or _queued(client, queue) > 0
        idle_since = None if busy else (idle_since or now)
        if idle_since is not None and now - idle_since >= SETTLE:
            return
        display.update(_snapshot(record, reader, "draining", now))
        time.sleep(TICK)


def _snapshot(record: RunRecord, reader: Reader, phase: str, now: float) -> Snapshot:
    progress = reader.progress()
    until = min(now, record.end)
    due = sum(len(task.slots_between(record.start, until)) for task in schedule.TASKS)
    return Snapshot(
        phase=phase,
        elapsed=now - record.start,
        left=max(0.0, record.end - now),
        due=due,
        completed=progress.completed,
        running=progress.running,
        skipped=progress.skipped,
    )


def _queued(client: Celery, queue: str) -> int:
    """Messages waiting in ``queue`` (any broker kombu supports)."""
    with client.connection_for_read() as conn:
        channel: Any = conn.default_channel
        # Not passive: Redis knows no empty queue, and would answer 404.
        declared = channel.queue_declare(queue=queue, durable=True, auto_delete=False)
        return int(declared.message_count)
