"""Fencing tokens across a failover: a token issued after a promotion is larger than every
token issued before it, even when asynchronous replication lost the last ones.

The replica is left behind on purpose: its WAL shipping is cut while the primary hands out
far more than the 32 values a sequence logs ahead; then the primary crashes and the
replica is promoted. Without schema version 5 the new primary's first tokens were below
the old primary's last (34 after 85), and a stale holder's fenced write was accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from celery_pglock import StaleToken, fence
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store._database import Database, close_all
from celery_pglock.testing._replication import timeline
from tests.failover.conftest import Cluster

pytestmark = pytest.mark.failover

SCHEMA = "failover_tokens"
BEHIND_BY = 100  # tokens the primary issues once the replica no longer receives WAL


@pytest.fixture
def db(cluster: Cluster) -> Iterator[Database]:
    database = Database(Settings(dsn=cluster.dsn, schema=SCHEMA))
    database.open()
    try:
        yield database
    finally:
        database.close()
        close_all()


def token_of(db: Database, name: str) -> int:
    """Take and free lock ``name`` (no slot); the fencing token it was granted."""
    lease = acquire(db, Claim(name, lock_key(name), None, "t-1", "tests.failover"), "session", None)
    assert isinstance(lease, Lease)
    release(db, lease, "succeeded")
    return int(lease.token)


def behind_by_many_tokens(cluster: Cluster, db: Database) -> int:
    """Leave the replica behind by ``BEHIND_BY`` tokens; the largest the primary issued."""
    token_of(db, "warm")
    cluster.replica.wait_replayed()
    cluster.replica.stop_shipping()
    return max(token_of(db, f"behind-{n}") for n in range(BEHIND_BY))


def test_tokens_after_a_lossy_promotion_are_larger_than_all_before(
    cluster: Cluster, db: Database
) -> None:
    largest_before = behind_by_many_tokens(cluster, db)

    cluster.fail_over()

    assert 2 == timeline(cluster.replica)
    after = [token_of(db, f"after-{n}") for n in range(5)]
    assert min(after) > largest_before
    assert after == sorted(after)


def test_a_token_from_before_the_failover_is_refused_once_a_newer_holder_wrote(
    cluster: Cluster, db: Database
) -> None:
    """The old primary's last holder writes on the new primary after a newer holder did:
    refused, although the replica never saw that old token issued."""
    stale = behind_by_many_tokens(cluster, db)
    cluster.fail_over()
    newer = token_of(db, "behind-0")

    with psycopg.connect(cluster.dsn) as conn:
        with conn.transaction():
            fence(conn, "billing", newer, tables=db.tables)
        with pytest.raises(StaleToken), conn.transaction():
            fence(conn, "billing", stale, tables=db.tables)


def test_the_first_tokens_of_a_new_timeline_are_all_distinct(
    cluster: Cluster, db: Database
) -> None:
    """Many holders racing to raise the sequence at once: one raises it, no token twice."""
    largest_before = behind_by_many_tokens(cluster, db)
    cluster.fail_over()

    with ThreadPoolExecutor(max_workers=8) as pool:
        tokens = list(pool.map(lambda n: token_of(db, f"race-{n}"), range(40)))

    assert len(set(tokens)) == len(tokens)
    assert min(tokens) > largest_before


def test_a_failover_without_loss_keeps_tokens_growing(cluster: Cluster, db: Database) -> None:
    """The replica had everything: tokens still only grow, by the timeline's jump."""
    before = token_of(db, "before")
    cluster.replica.wait_replayed()
    cluster.fail_over()

    assert token_of(db, "after") > before
