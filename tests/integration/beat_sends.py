"""What beat claimed in the ledger and what the broker holds, for the in-process beat tests."""

from __future__ import annotations

import json
from collections import Counter

import psycopg
import redis
from psycopg import sql

from celery_pglock.schema import Tables


def claims(dsn: str, schema: str, namespace: str) -> dict[tuple[str, str], bool]:
    """(entry, slot) -> confirmed, for every claim of the namespace."""
    query = sql.SQL("SELECT entry, slot, sent_at IS NOT NULL FROM {} WHERE namespace = %s")
    with psycopg.connect(dsn, autocommit=True) as conn:
        table = Tables(schema).table("beat_sends")
        rows = conn.execute(query.format(table), [namespace]).fetchall()
    return {(entry, slot): confirmed for entry, slot, confirmed in rows}


def messages(client: redis.Redis, queue: str) -> Counter[tuple[str, str]]:
    """(entry, slot) -> how many messages the broker holds for it."""
    found: Counter[tuple[str, str]] = Counter()
    for raw in client.lrange(queue, 0, -1):
        headers = json.loads(raw)["headers"]
        found[(headers["pglock_entry"], headers["pglock_slot"])] += 1
    return found
