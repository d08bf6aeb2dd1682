"""Beat tick scale: 10,000 entries due in the same tick (``benchmarks.beat_failover``).

``PgLockScheduler`` claims every due slot in one round trip, publishes, and confirms in
one more; stock Celery beat sends the same entries one per ``tick()``. The target: the
claims cost less than the sends they guard.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import redis

from benchmarks import beat_failover, common
from celery_pglock.db import close_all


@dataclass
class Result:
    pglock: list[dict[str, float]]
    stock: list[dict[str, float]]
    entries: int
    load: common.LoadWindow


def run(dsn: str, broker: str, *, rounds: int, stock: bool) -> Result:
    load = common.LoadWindow()
    kinds = ["pglock"] * rounds + (["stock"] if stock else [])
    results: dict[str, list[dict[str, float]]] = {"pglock": [], "stock": []}
    client = redis.Redis.from_url(broker)
    with common.private_schema(dsn, "tick") as schema:
        for kind in kinds:
            queue = f"{common.KEY_PREFIX}-tick-{uuid.uuid4().hex[:8]}"
            app = beat_failover.tick_app(dsn, broker, schema, queue)
            try:
                tick = beat_failover.pglock_tick if kind == "pglock" else beat_failover.stock_tick
                results[kind].append(tick(app))
                sent = client.llen(queue)
                assert sent == beat_failover.TICK_ENTRIES, sent
            finally:
                client.delete(queue)
                app.close()
                close_all()
            print(f"  tick, {kind}: {results[kind][-1]}", flush=True)
    client.close()
    load.close()
    return Result(results["pglock"], results["stock"], beat_failover.TICK_ENTRIES, load)
