"""Beat at scale: 1,000 and 10,000 entries due in the same tick.

One ``PgLockScheduler`` in this process (a real PostgreSQL, a real Redis broker, leader
election on) holds N entries of one 10-s interval, so all of them fall due on the same
boundary; the tick that claims them is measured:

- *span*: tick start to the end of the last confirmation (every claim sent and confirmed);
- *first confirmed*: tick start to the end of the first confirmation (how long the first
  sends stay unconfirmed: what a leader killed mid-tick leaves behind);
- *claim* and *confirm*: time in those statements (confirmations: how many round trips);
- *CPU per send*: this process's CPU time over the tick, and its senders' (forked with
  ``pglock_beat_senders``), divided by the messages sent (Celery's publish, kombu,
  redis-py and ours together).

Every message is counted on the broker afterwards.
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from benchmarks import common
from celery_pglock.beat import PgLockScheduler
from celery_pglock.store._database import close_all

SIZES = (1_000, 10_000)
EVERY = 10.0  # seconds: every entry falls due on the same boundary


@dataclass
class Tick:
    entries: int
    span: float
    first_confirmed: float
    claim: float
    confirm: float
    confirms: int
    cpu_per_send: float


@dataclass
class Result:
    ticks: list[Tick]
    load: common.LoadWindow


def tick_app(dsn: str, broker: str, schema: str, queue: str, entries: int) -> Celery:
    app = Celery("bench-tick", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        task_default_queue=queue,
        pglock_dsn=dsn,
        pglock_schema=schema,
        pglock_namespace=f"tick-{uuid.uuid4().hex[:8]}",
        beat_schedule={
            f"e{i:05d}": {"task": "bench.noop", "schedule": EVERY} for i in range(entries)
        },
    )
    return app


class Probe:
    """Wraps a scheduler's claims object: when each claim and confirmation ended."""

    def __init__(self, scheduler: Any) -> None:
        claims = scheduler.pglock_claims
        self.claimed = 0
        self.claim = 0.0
        self.confirm = 0.0
        self.confirm_ends: list[float] = []
        claim, confirm = claims.claim, claims.confirm

        def timed_claim(due: Any) -> Any:
            start = time.perf_counter()
            result = claim(due)
            self.claim += time.perf_counter() - start
            self.claimed += len(result.send)
            return result

        def timed_confirm(sent: Any) -> None:
            start = time.perf_counter()
            confirm(sent)
            end = time.perf_counter()
            self.confirm += end - start
            if sent:
                self.confirm_ends.append(end)

        claims.claim, claims.confirm = timed_claim, timed_confirm


def measure(app: Celery, entries: int) -> Tick:
    """The first tick that sends: every entry falls due on the same boundary."""
    scheduler = PgLockScheduler(app=app)
    probe = Probe(scheduler)
    try:
        connection = scheduler.producer.connection
        assert connection is not None
        connection.ensure_connection()  # before timing
        deadline = time.monotonic() + 4 * EVERY
        while time.monotonic() < deadline:
            probe.confirm_ends.clear()
            cpu, start = _cpu(), time.perf_counter()
            wait = scheduler.tick()
            cpu = _cpu() - cpu
            if probe.claimed:
                break
            time.sleep(wait)
        assert probe.claimed == entries, probe.claimed
        return Tick(
            entries=entries,
            span=probe.confirm_ends[-1] - start,
            first_confirmed=probe.confirm_ends[0] - start,
            claim=probe.claim,
            confirm=probe.confirm,
            confirms=len(probe.confirm_ends),
            cpu_per_send=cpu / entries,
        )
    finally:
        scheduler.close()


def _cpu() -> float:
    """This process's CPU time and its reaped children's (``pglock_beat_senders``)."""
    times = os.times()
    return time.process_time() + times.children_user + times.children_system


def run(dsn: str, broker: str, *, rounds: int, sizes: tuple[int, ...] = SIZES) -> Result:
    load = common.LoadWindow()
    ticks = []
    client = redis.Redis.from_url(broker)
    with common.private_schema(dsn, "tick") as schema:
        for _ in range(rounds):
            for entries in sizes:
                queue = f"{common.KEY_PREFIX}-tick-{uuid.uuid4().hex[:8]}"
                app = tick_app(dsn, broker, schema, queue, entries)
                try:
                    ticks.append(measure(app, entries))
                    sent = client.llen(queue)
                    assert sent == entries, sent
                finally:
                    client.delete(queue)
                    app.close()
                    close_all()
                print(f"  tick: {ticks[-1]}", flush=True)
    client.close()
    load.close()
    return Result(ticks, load)
