"""Where the library meets the driver: what a psycopg error means, decided in one place.

``translate`` turns any driver error into the library's, whose class is its kind:

- ``SessionGone``: an established session ended (its advisory locks are gone with it);
- ``ReadOnlyServer``: the server takes no writes (a standby, a demoted primary);
- ``DatabaseMisconfigured``: a refusal only a fix cures (credentials, an unknown database
  or role, missing privileges, a malformed connection string), naming the fix;
- ``DatabaseUnavailable``: an outage that waiting cures (down, starting, shutting down,
  in recovery); ``ServerFull`` when it is out of connection slots;
- ``WaitEnded``: a wait in a lock queue ran out;
- ``StatementFailed``: anything else a statement met on a live session.

Every module above the connection layer catches these, never the driver's own errors
(``tests/unit/test_failures.py`` keeps it so); ``boundary`` is the usual way in. The
password of the DSN never reaches a message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg

from celery_pglock._config import Settings
from celery_pglock._dsn import redact
from celery_pglock.errors import (
    DatabaseError,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    ReadOnlyServer,
    ServerFull,
    SessionGone,
    StatementFailed,
    WaitEnded,
)

Error = psycopg.Error  # the driver's root: the one name other layers may not catch

# Refusals after the session started carry their SQLSTATE.
FIX_BY_STATE = {
    "28000": "check the user name in pglock_dsn and the server's pg_hba.conf",
    "28P01": "check the password in pglock_dsn (or PGLOCK_DSN)",
    "3D000": "check the database name in pglock_dsn",
    "3F000": "create the schema named by pglock_schema, or fix pglock_schema",
    "42501": (
        "grant the role USAGE and CREATE on the schema named by pglock_schema (or create the "
        "tables as their owner with `celery -A proj pglock migrate` and set "
        "pglock_auto_migrate = False)"
    ),
}
# A refusal while connecting has none (libpq only has the text): the server's FATAL
# messages and libpq's own, as they read untranslated (lc_messages = C, the default). A
# text that matches none is taken for an outage: waiting with the reason in every
# WARNING is safer than exiting on a message that merely changed.
FIX_BY_MESSAGE = tuple(
    (re.compile(pattern), fix)
    for pattern, fix in (
        ("password authentication failed", FIX_BY_STATE["28P01"]),
        ("no password supplied", "add the password to pglock_dsn (or PGLOCK_DSN)"),
        ("authentication failed", FIX_BY_STATE["28000"]),
        ("no pg_hba.conf entry|pg_hba.conf rejects", "allow this host in pg_hba.conf"),
        ("is not permitted to log in", "give the role in pglock_dsn the LOGIN attribute"),
        ("permission denied for database", "grant the role CONNECT on the database"),
        ('role ".*" does not exist', "check the user name in pglock_dsn"),
        ('database ".*" does not exist|no such database', FIX_BY_STATE["3D000"]),
        ("server does not support SSL", "drop sslmode=require from pglock_dsn"),
    )
)
# The server's refusals for want of a connection slot (SQLSTATE 53300 when it has one), and
# PgBouncer's beyond its max_client_conn (or max_user_client_connections): no SQLSTATE.
FULL = re.compile(
    r"too many clients|too many connections for role|remaining connection slots are reserved"
    r"|no more connections allowed"
)
TRANSIENT = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.InternalError, OSError)
WAIT_ENDED = (psycopg.errors.LockNotAvailable, psycopg.errors.QueryCanceled)


def misconfiguration(exc: BaseException) -> str | None:
    """The fix for ``exc``, met while connecting, when it is a misconfiguration; None
    when it is an outage."""
    state = getattr(exc, "sqlstate", None)
    if state in FIX_BY_STATE:
        return FIX_BY_STATE[state]
    text = str(exc)
    for pattern, fix in FIX_BY_MESSAGE:
        if pattern.search(text):
            return fix
    if isinstance(exc, TRANSIENT):
        return None
    # Another refusal of the server (an invalid connection option, a syntax it rejects):
    # the same again after any wait.
    return "check pglock_dsn and the settings named in the message"


def session_gone(exc: BaseException, conn: Any = None) -> bool:
    """Whether ``exc``, met on an established session (``conn``), means it ended. The
    server ends one with an error of another class too (IdleInTransactionSessionTimeout
    is an InternalError; behind PgBouncer a dead server can answer InternalError): a
    closed or broken connection says so."""
    broken = conn is not None and (conn.closed or conn.broken)
    return isinstance(exc, (psycopg.OperationalError, OSError)) or bool(broken)


def translate(
    exc: BaseException, settings: Settings | None = None, conn: Any = None
) -> DatabaseError:
    """The library's error for driver error ``exc``; ``settings``: to name the server.

    ``conn``: the session it was met on, when the caller must tell a session that ended
    (its locks with it) from a statement's own failure or a wait cut short. Without it,
    as while connecting or setting a session up, every error is an outage or a
    misconfiguration (and a server that takes no writes, read-only)."""
    where = "PostgreSQL" if settings is None else f"PostgreSQL at {redact(settings.dsn)!r}"
    cause = first_line(exc)
    found = _classified(exc, conn, where, cause)
    found.sqlstate = getattr(exc, "sqlstate", None)
    found.cause = f"{type(exc).__name__}: {cause}"
    return found


def _classified(exc: BaseException, conn: Any, where: str, cause: str) -> DatabaseError:
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return read_only(where)
    if conn is not None:
        if isinstance(exc, WAIT_ENDED) and not conn.broken:
            return WaitEnded(f"{where}: {cause}")  # first: they are OperationalErrors too
        if session_gone(exc, conn):
            return SessionGone(f"the session with {where} ended: {cause}")
        return StatementFailed(f"{where}: {cause}")
    return _refused(exc, where, cause)


def _refused(exc: BaseException, where: str, cause: str) -> DatabaseError:
    """A failure while connecting or setting a session up."""
    if getattr(exc, "sqlstate", None) == "53300" or FULL.search(str(exc)):
        return ServerFull(f"{where} has no connection slot left: {cause}")
    fix = misconfiguration(exc)
    if fix is not None:
        return DatabaseMisconfigured(f"cannot use {where}: {cause}. To fix: {fix}.")
    return DatabaseUnavailable(
        f"cannot use {where}: {cause}. Check pglock_dsn (or PGLOCK_DSN), that the server is "
        "running and that this host may connect."
    )


def read_only(where: str) -> ReadOnlyServer:
    """The server ``where`` names takes no writes: a standby, or a primary demoted."""
    return ReadOnlyServer(
        f"{where} is read-only (a standby, a primary demoted by a failover, or "
        "default_transaction_read_only): celery-pglock writes its ledger on the primary. "
        "Point pglock_dsn at the primary, or list every host and add "
        "target_session_attrs=read-write (postgresql://h1:5432,h2:5432/db?"
        "target_session_attrs=read-write): libpq then connects to the writable one."
    )


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its class name when empty), passwords hidden."""
    text = str(exc).strip()
    return redact(text.splitlines()[0] if text else type(exc).__name__)


@contextmanager
def boundary(settings: Settings | None = None, conn: Any = None) -> Iterator[None]:
    """Driver errors raised inside become ``translate``'s; ``conn``: the session the
    statements inside run on, when its end must be told apart (see ``translate``)."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, settings, conn) from None


__all__ = ["boundary", "first_line", "misconfiguration", "read_only", "session_gone", "translate"]
