"""Where the library meets the driver: what a psycopg error means, decided in one place.

``misconfiguration`` tells an outage, which waiting cures (the server is down, starting,
shutting down, in recovery, out of connection slots, or ended our session), from a
refusal that only a fix cures (wrong credentials, an unknown database or role, missing
privileges, a malformed connection string), and names the fix. ``translate`` (and
``boundary``, around statements) applies it: a task retries both kinds (an operator may
fix the second meanwhile); a process starting up waits for the first only. The password
of the DSN never reaches a message.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from celery_pglock.config import Settings, redact
from celery_pglock.errors import DatabaseMisconfigured, DatabaseUnavailable

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
TRANSIENT = (psycopg.OperationalError, psycopg.InterfaceError, psycopg.InternalError, OSError)


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


def translate(exc: BaseException, settings: Settings) -> DatabaseUnavailable:
    """A ``DatabaseUnavailable`` naming the server (never the password) and the cause: an
    outage, or a ``DatabaseMisconfigured`` that names the fix (``misconfiguration``)."""
    where = f"PostgreSQL at {redact(settings.dsn)!r}"
    if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
        return read_only(where)
    cause = first_line(exc)
    fix = misconfiguration(exc)
    if fix is not None:
        return DatabaseMisconfigured(f"cannot use {where}: {cause}. To fix: {fix}.")
    return DatabaseUnavailable(
        f"cannot use {where}: {cause}. Check pglock_dsn (or PGLOCK_DSN), that the server is "
        "running and that this host may connect."
    )


def read_only(where: str) -> DatabaseMisconfigured:
    """The server ``where`` names takes no writes: a standby, or a primary demoted."""
    return DatabaseMisconfigured(
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
def boundary(settings: Settings) -> Iterator[None]:
    """Driver errors raised inside become ``translate``'s."""
    try:
        yield
    except psycopg.Error as exc:
        raise translate(exc, settings) from None


__all__ = ["boundary", "first_line", "misconfiguration", "read_only", "translate"]
