"""A large tick sent by forked senders (``pglock_beat_senders = 2``), through a real Redis
broker and confirmed in a real PostgreSQL: every claim on the broker once and confirmed;
a sender SIGKILLed mid-tick leaves its unreported claims to the leader, which sends them
(the batch it had put on the broker unreported is there twice, nothing is missing).

One ``PgLockScheduler`` (leader election on) in this process; its senders are real
processes forked from it, found and killed as an operator would (``/proc``, SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_pglock.beat import PgLockScheduler
from celery_pglock.beat._sending import CONFIRM_BATCH
from celery_pglock.store._database import close_all
from tests.fixtures.procs import children_of, wait_until
from tests.integration.beat_sends import claims, messages

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds senders in /proc"),
]

ENTRIES = 1_500  # 750 a sender: long enough to kill one in the middle
EVERY = 4.0  # seconds: every entry falls due on the same boundary
DEADLINE = 4 * EVERY


@pytest.fixture
def lab(pg_dsn: str, pglock_schema: str, redis_url: str) -> Iterator[dict[str, Any]]:
    queue = f"beat-senders-{uuid.uuid4().hex[:8]}"
    namespace = f"senders-{uuid.uuid4().hex[:6]}"
    app = Celery(f"senders{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        task_default_queue=queue,
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=namespace,
        pglock_beat_senders=2,
        pglock_beat_resend_after=3600,  # nothing re-sent by the timer here
        beat_schedule={
            f"e{i:05d}": {"task": "senders.noop", "schedule": EVERY} for i in range(ENTRIES)
        },
    )
    client = redis.Redis.from_url(redis_url)
    try:
        yield {"app": app, "queue": queue, "redis": client, "namespace": namespace}
    finally:
        client.delete(queue)
        client.close()
        app.close()
        close_all()


def children() -> list[int]:
    """This process's child processes (the senders while a tick is shared)."""
    return sorted(children_of(os.getpid()))


def tick_until_sent(scheduler: PgLockScheduler, found: Any) -> None:
    """Tick (as beat does) until the first slot's claims are all confirmed."""

    def sent() -> bool:
        scheduler.tick()
        confirmed = found()
        return bool(confirmed) and all(confirmed.values())

    wait_until(sent, timeout=DEADLINE, interval=0.05, message="the tick sent and confirmed")


def test_two_senders_put_every_claim_on_the_broker_once_and_confirm_it(
    lab: dict[str, Any], pg_dsn: str, pglock_schema: str
) -> None:
    scheduler = PgLockScheduler(app=lab["app"])
    try:
        tick_until_sent(scheduler, lambda: claims(pg_dsn, pglock_schema, lab["namespace"]))
    finally:
        scheduler.close()

    found = claims(pg_dsn, pglock_schema, lab["namespace"])
    sent = messages(lab["redis"], lab["queue"])
    assert ENTRIES == len(found)
    assert set(found) == set(sent)
    assert {1} == set(sent.values()), {claim: n for claim, n in sent.items() if n > 1}
    assert [] == children()  # every sender reaped


def test_a_sender_killed_mid_tick_leaves_its_claims_to_the_leader_which_sends_them(
    lab: dict[str, Any], pg_dsn: str, pglock_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGKILL one sender once the first batch is on the broker: every claim is on the
    broker and confirmed; the doubles are at most the batch it had sent unreported."""
    client, queue = lab["redis"], lab["queue"]
    killed: list[int] = []

    def kill_a_sender() -> None:
        def first_batch_out() -> bool:
            return bool(client.llen(queue)) and bool(children())

        wait_until(first_batch_out, timeout=DEADLINE, interval=0.001, message="a batch out")
        killed.append(children()[0])
        os.kill(killed[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_a_sender, daemon=True)
    killer.start()
    scheduler = PgLockScheduler(app=lab["app"])
    try:
        with caplog.at_level(logging.WARNING, logger="celery_pglock.beat"):
            tick_until_sent(scheduler, lambda: claims(pg_dsn, pglock_schema, lab["namespace"]))
    finally:
        scheduler.close()
    killer.join(timeout=DEADLINE)

    assert killed, "no sender was found to kill"
    found = claims(pg_dsn, pglock_schema, lab["namespace"])
    sent = messages(lab["redis"], lab["queue"])
    assert ENTRIES == len(found)
    assert set(found) == set(sent)  # nothing missing
    doubles = sum(n - 1 for n in sent.values())
    assert doubles <= CONFIRM_BATCH, doubles
    assert any(r.action == "pglock_beat_sender_died" for r in caplog.records)  # type: ignore[attr-defined]
    assert [] == children()
