"""What an outage is, and one ERROR line per outage, not one per task that noticed it.

``misconfiguration`` tells an outage, which waiting cures (the server is down, starting,
shutting down, in recovery, out of connection slots, or ended our session), from a
refusal that only a fix cures (wrong credentials, an unknown database or role, missing
privileges, a malformed connection string), and names the fix. ``db.translate_error``
applies it to every error met while connecting: a task retries both kinds (an operator
may fix the second meanwhile); a process starting up waits for the first only.

During an outage every locked task fails its acquire and is retried; logging each at
ERROR buries the one line an operator needs. ``OutageLog`` hands out ERROR for the first
failure, WARNING for the rest, and logs one INFO line when PostgreSQL answers again.
"""

from __future__ import annotations

import logging
import re
import threading

import psycopg

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
    """The fix for ``exc`` when it is a misconfiguration; None when it is an outage."""
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


class OutageLog:
    """Per-process outage state; ``succeeded()`` costs one attribute read when all is well."""

    def __init__(self, logger: logging.Logger, action: str) -> None:
        self.logger = logger
        self.action = action
        self.active = False
        self._lock = threading.Lock()

    def failed(self) -> int:
        """The level to log this failure at: ERROR if it starts an outage, else WARNING."""
        with self._lock:
            first, self.active = not self.active, True
        return logging.ERROR if first else logging.WARNING

    def succeeded(self) -> None:
        """PostgreSQL answered: end the outage, saying so once."""
        if not self.active:
            return
        with self._lock:
            if not self.active:
                return
            self.active = False
        self.logger.info("PostgreSQL is reachable again", extra={"action": self.action})
