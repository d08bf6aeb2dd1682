"""One connection to PostgreSQL, as the library opens it: its options, its name in
``pg_stat_activity``, what it checks of the server (writable, reached directly or through
a pooler), and its watch on a client that died while it waited.

Pools of such connections, per process, are ``db``'s; what a driver error means is
``failures``'.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import psycopg

from celery_pglock._config import Settings
from celery_pglock._dsn import redact
from celery_pglock.schema import statement
from celery_pglock.store._driver import Connection
from celery_pglock.store._failures import boundary, read_only

logger = logging.getLogger("celery_pglock")

_PING = statement("ping")
TCP_USER_TIMEOUT_MS = 30_000
LEASE_MIN_SERVER_VERSION = 140000  # idle_session_timeout appeared in PostgreSQL 14
CLIENT_CHECK_MS = 1000  # how often a waiting backend looks whether its client is alive
HOSTNAME = socket.gethostname()

PREPARE_THRESHOLD = 5  # psycopg's default: a statement run this often is prepared
POOLER_PROBES = 5  # rounds of the transaction-pooler check (``transaction_pooled``)

FIX_BACKEND = 'set pglock_lock_backend = "auto" (locks on rows behind a pooler), or'


def application_name(role: str = "") -> str:
    """What ``pg_stat_activity`` shows for our connections (PostgreSQL keeps 63 bytes)."""
    name = f"celery-pglock{role} {os.getpid()}@{HOSTNAME}"
    return name.encode()[:63].decode("utf-8", "ignore")


def connect_kwargs(settings: Settings) -> dict[str, Any]:
    """libpq options for every connection: fail fast, detect dead peers."""
    timeout = max(1, round(settings.connect_timeout))
    return {
        "autocommit": True,
        "connect_timeout": timeout,
        "keepalives": 1,
        "keepalives_idle": 10,
        "keepalives_interval": 3,
        "keepalives_count": 3,
        # A send to a partitioned server fails after this instead of TCP's ~15 minutes.
        "tcp_user_timeout": TCP_USER_TIMEOUT_MS,
        "application_name": application_name(),
    }


def connect(settings: Settings, **overrides: Any) -> Connection:
    """A new, unpooled connection (CLI, beat leader, start-up checks). It prepares no
    statement: whether a transaction pooler stands in between is not known yet (or never
    checked), and a statement prepared on one server connection is unknown to the next
    one the pooler picks (psycopg prepares one run five times: the pooler check, a
    migration, a prune's batches). The beat leader's session, never pooled, prepares."""
    options = {**connect_kwargs(settings), "prepare_threshold": None, **overrides}
    with boundary(settings):
        return psycopg.connect(settings.dsn, **options)


def show_setting(conn: Connection, name: str) -> str | None:
    """The server's current value of setting ``name``."""
    row = conn.execute(statement("show_setting"), {"name": name}).fetchone()
    return str(row[0]) if row else None


def check_writable(conn: Connection, settings: Settings) -> None:
    """Raise ``ReadOnlyServer`` unless ``conn``'s server takes writes."""
    if show_setting(conn, "transaction_read_only") == "on":
        raise read_only(f"PostgreSQL at {redact(settings.dsn)!r}")


def watch_client(conn: Connection) -> None:
    """Make ``conn``'s statements end soon after this process dies (PostgreSQL >= 14)."""
    if conn.info.server_version >= LEASE_MIN_SERVER_VERSION:
        conn.execute(statement("watch_client"), {"ms": str(CLIENT_CHECK_MS)})


def transaction_pooled(conn: Connection, settings: Settings) -> bool:
    """Whether ``conn`` goes through a transaction pooler (PgBouncer pool_mode=transaction).

    Proof, not guess: in between our statements a second connection, inside a transaction,
    reports the backend ``conn`` just used (two open clients sharing a server session), or
    ``conn`` itself moved to another backend. Directly or through a session pooler neither
    can happen. A pooler reusing server connections last-in first-out (PgBouncer's default)
    hands the second connection that very backend, unless another client of the pooler
    took it in between (processes starting at once: a prefork worker's children). Then
    that client holds it, or held it only for a moment: ``conn`` is asked again while the
    second connection's transaction holds its own backend, and a round that proves
    nothing is tried again, ``POOLER_PROBES`` rounds in all. Costs one connection and 3
    round trips a round (a direct connection takes all the rounds).
    """
    with connect(settings) as other:
        for _ in range(POOLER_PROBES):
            first = _backend_pid(conn)
            with other.transaction():
                if _backend_pid(other) == first or _backend_pid(conn) != first:
                    return True
    return False


def ping(conn: Connection) -> None:
    """One round trip on ``conn``; the library's error (``failures``) if its session is
    gone or cannot answer."""
    with boundary(conn=conn):
        conn.execute(_PING)


def cut_off(conn: Connection) -> bool:
    """Whether a statement on ``conn`` was cut off mid-way, or the connection broke: the
    state of its session, locks included, is unknown."""
    return conn.info.transaction_status == psycopg.pq.TransactionStatus.ACTIVE or conn.broken


def in_transaction(conn: Connection) -> bool:
    """Whether ``conn`` is not idle: inside a transaction, a failed one, or unknown."""
    return conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE


def _backend_pid(conn: Connection) -> int:
    row = conn.execute(statement("backend_pid")).fetchone()
    return int(row[0]) if row else 0


def pooler_message(settings: Settings, what: str, fix: str) -> str:
    return (
        f"{what} cannot work through a transaction pooler (PgBouncer pool_mode=transaction) "
        f"at {redact(settings.dsn)!r}: the lock would stay behind on a server connection that "
        f"other clients then use. To fix: {fix} point pglock_dsn at PostgreSQL itself or at a "
        "session-pooling PgBouncer"
    )


def close_quietly(conn: Connection) -> None:
    """Close ``conn`` (its session ends, and the server frees its locks); a failure to say
    goodbye to a server that is gone already is no error."""
    try:
        conn.close()
    except (psycopg.Error, OSError):
        logger.debug("closing a connection failed", exc_info=True)


def cancel_quietly(conn: Connection) -> None:
    """Cancel the statement ``conn`` is waiting in, from another thread; a session that
    already ended has nothing left to cancel."""
    try:
        conn.cancel_safe(timeout=1.0)
    except (psycopg.Error, OSError):
        logger.debug("cancelling a wait failed", exc_info=True)
