"""A DSN that lands on a read-only server (a standby, a primary demoted by a failover,
``default_transaction_read_only``): a clear error naming ``target_session_attrs``, at
start-up and at run time, never a raw driver error; with several hosts and
``target_session_attrs=read-write`` libpq picks the writable one.

Two throwaway servers of their own; one is made read-only with
``default_transaction_read_only``, which libpq's ``read-write`` check sees as a standby."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from psycopg.conninfo import make_conninfo

from celery_pglock import DatabaseUnavailable
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.store._database import Database, close_all
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps.harness import app_env
from tests.fixtures.pg import started_embedded
from tests.fixtures.procs import Procs

pytestmark = pytest.mark.faults

SCHEMA = "ro_test"


@pytest.fixture
def read_only() -> Iterator[EmbeddedPostgres]:
    with started_embedded() as server:
        server.set_config(default_transaction_read_only="on")
        yield server


@pytest.fixture
def writable() -> Iterator[EmbeddedPostgres]:
    with started_embedded() as server:
        yield server


def both_hosts(first: EmbeddedPostgres, second: EmbeddedPostgres, **extra: str) -> str:
    """libpq's multi-host form: ``host=a,b port=p,q``, tried in that order."""
    return make_conninfo(
        host="127.0.0.1,127.0.0.1",
        port=f"{first.port},{second.port}",
        user="postgres",
        dbname="postgres",
        **extra,
    )


def claim(name: str) -> Claim:
    return Claim(name, lock_key(name), "2026-12-01", "t-1", "tests.ro")


def test_a_read_only_server_is_refused_at_start_naming_target_session_attrs(
    read_only: EmbeddedPostgres,
) -> None:
    db = Database(Settings(dsn=read_only.dsn, schema=SCHEMA))

    with pytest.raises(DatabaseUnavailable, match=r"read-only.*target_session_attrs=read-write"):
        db.open()


def test_with_several_hosts_read_write_picks_the_writable_one(
    read_only: EmbeddedPostgres, writable: EmbeddedPostgres
) -> None:
    dsn = both_hosts(read_only, writable, target_session_attrs="read-write")
    db = Database(Settings(dsn=dsn, schema=SCHEMA))
    db.open()
    try:
        lease = acquire(db, claim("ro:job"), "session", None)
        assert isinstance(lease, Lease)
        assert writable.port == lease.connection.info.port
        release(db, lease, "succeeded")
    finally:
        db.close()


def test_a_server_that_turns_read_only_fails_the_next_lock_naming_the_fix(
    writable: EmbeddedPostgres,
) -> None:
    """A primary demoted under a running worker: its pooled connections now reach a
    read-only server. The next lock fails with the same clear error, and the connection is
    dropped, so that the one after it connects afresh (to the new primary, with
    target_session_attrs)."""
    db = Database(Settings(dsn=writable.dsn, schema=SCHEMA))
    db.open()
    try:
        release(db, acquire(db, claim("ro:before"), "session", None), "succeeded")  # type: ignore[arg-type]
        writable.set_config(default_transaction_read_only="on")

        with pytest.raises(DatabaseUnavailable, match=r"read-only.*target_session_attrs"):
            acquire(db, claim("ro:after"), "session", None)

        writable.set_config(default_transaction_read_only="off")
        assert isinstance(acquire(db, claim("ro:again"), "session", None), Lease)
    finally:
        db.close()
        close_all()


def test_beat_on_a_read_only_server_stops_naming_the_fix(
    read_only: EmbeddedPostgres, redis_url: str, procs: Procs
) -> None:
    """The leader election starts on the first tick: there beat finds the server
    read-only and stops, with the fix named rather than a driver error."""
    env = app_env(pg_dsn=read_only.dsn, schema=SCHEMA, broker_url=redis_url)
    beat = procs.celery("tests.apps.testapp", "beat", "--loglevel=INFO", env=env, name="beat")

    status = beat.wait(timeout=60)

    assert status != 0
    assert "target_session_attrs=read-write" in beat.log_text()
    assert "ReadOnlySqlTransaction" not in beat.log_text()
