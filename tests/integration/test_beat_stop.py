"""Beat stopped between claim and confirmation (issue 28): it finishes the tick, or, stopped
twice, confirms what it sent, and the next leader sends the rest at its first tick, not
after ``pglock_beat_resend_after``.

Two ``PgLockScheduler`` replicas in this process, leader election on, a real PostgreSQL
and a real Redis broker (messages counted on the queue). The leader is stopped the way
``celery beat`` stops on SIGTERM: Celery's signal handler runs in the middle of the tick
(here, right after a publish), calls the scheduler's ``close()``, and raises SystemExit.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_pglock.beat import PgLockScheduler
from celery_pglock.store._database import close_all
from tests.fixtures.procs import wait_until
from tests.integration.beat_sends import claims, messages

pytestmark = pytest.mark.integration

ENTRIES = 60
STOP_AFTER = 10  # messages out before the stop
DEADLINE = 30.0


def make_app(dsn: str, schema: str, broker: str, queue: str, namespace: str) -> Celery:
    app = Celery(f"stop{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker,
        task_default_queue=queue,
        pglock_dsn=dsn,
        pglock_schema=schema,
        pglock_namespace=namespace,
        # every entry falls due on the same boundary; none is re-sent by the timer here
        pglock_beat_resend_after=3600,
        beat_schedule={f"e{i:03d}": {"task": "stop.noop", "schedule": 2.0} for i in range(ENTRIES)},
    )
    return app


@pytest.fixture
def lab(pg_dsn: str, pglock_schema: str, redis_url: str) -> Iterator[dict[str, Any]]:
    queue = f"beat-stop-{uuid.uuid4().hex[:8]}"
    namespace = f"stop-{uuid.uuid4().hex[:6]}"
    apps = [make_app(pg_dsn, pglock_schema, redis_url, queue, namespace) for _ in range(2)]
    client = redis.Redis.from_url(redis_url)
    try:
        yield {"apps": apps, "queue": queue, "redis": client, "namespace": namespace}
    finally:
        client.delete(queue)
        client.close()
        for app in apps:
            app.close()
        close_all()


def stop_like_sigterm_after(scheduler: Any, *counts: int) -> None:
    """After each of ``counts`` messages: what Celery's SIGTERM handler does
    (``service.sync()``, which closes the scheduler, then SystemExit), at that point."""
    publish, sent = scheduler.apply_async, []

    def apply_async(*args: Any, **kwargs: Any) -> Any:
        result = publish(*args, **kwargs)
        sent.append(1)
        if len(sent) in counts:
            scheduler.close()
            raise SystemExit
        return result

    scheduler.apply_async = apply_async


def stop_mid_tick(app: Celery, *counts: int) -> None:
    """Run a leader until the stops after ``counts`` messages end its tick."""
    old = PgLockScheduler(app=app)
    stop_like_sigterm_after(old, *counts)

    def stopped() -> bool:
        try:
            old.tick()
        except SystemExit:
            return True
        return False

    try:
        wait_until(stopped, timeout=DEADLINE, interval=0.05, message="the leader's tick")
    finally:
        old.close()


def test_a_beat_stopped_mid_tick_finishes_the_tick_and_confirms_it(
    lab: dict[str, Any], pg_dsn: str, pglock_schema: str
) -> None:
    """SIGTERM: the tick's remaining claims are sent, every one confirmed, then it exits."""
    stop_mid_tick(lab["apps"][0], STOP_AFTER)

    found = claims(pg_dsn, pglock_schema, lab["namespace"])
    sent = messages(lab["redis"], lab["queue"])
    assert set(found) == set(sent)
    assert ENTRIES == len(found) == sum(sent.values())
    # All confirmed but (at most) the one being published when the stop came.
    assert sum(found.values()) >= ENTRIES - 1, found


def test_a_beat_stopped_twice_confirms_what_it_sent_and_the_next_leader_sends_the_rest_at_once(
    lab: dict[str, Any], pg_dsn: str, pglock_schema: str
) -> None:
    """A second SIGTERM stops at once: what went out is confirmed, and the next leader
    sends the rest at its first tick, not after pglock_beat_resend_after."""
    stop_mid_tick(lab["apps"][0], STOP_AFTER, STOP_AFTER + 5)
    namespace = lab["namespace"]
    before = claims(pg_dsn, pglock_schema, namespace)
    [slot] = {slot for _, slot in before}
    assert ENTRIES == len(before)
    # What went out before the second stop is confirmed (but, at most, the message being
    # published when each stop came).
    assert STOP_AFTER + 3 <= sum(before.values()) <= STOP_AFTER + 5, before

    new = PgLockScheduler(app=lab["apps"][1])
    try:
        wait_until(lambda: new.tick() is not None and new.is_leader, timeout=DEADLINE)
        new.tick()  # the first tick as leader
        after = claims(pg_dsn, pglock_schema, namespace)
        sent = messages(lab["redis"], lab["queue"])
    finally:
        new.close()
    of_slot = {key: ok for key, ok in after.items() if key[1] == slot}
    assert all(of_slot.values()), sorted(k for k, ok in of_slot.items() if not ok)
    assert set(of_slot) == {key for key in sent if key[1] == slot}
    doubles = sum(n - 1 for key, n in sent.items() if key[1] == slot)
    assert doubles <= 2, sent
