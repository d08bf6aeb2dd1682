"""The exception root of celery-pglock.

Losing a race is an outcome, not an error: a skipped duplicate is reported as the
``SKIPPED`` state, never raised at the caller. These exceptions are for what a user
must fix or handle: bad configuration, an unreachable database, a lost lock, a stale
fencing token.
"""

from __future__ import annotations

from typing import Any


class PgLockError(Exception):
    """Something in celery-pglock went wrong; the message says what to fix."""


class ConfigurationError(PgLockError):
    """A setting is missing or invalid; the message names the setting and the fix."""


class NotPgLockScheduler(ConfigurationError):
    """The app's ``beat_scheduler`` is not a PgLockScheduler: its entries cannot be steered."""


class UnknownEntry(ConfigurationError):
    """No beat entry has the name given; the message names the nearest ones."""


class DatabaseError(PgLockError):
    """A driver error, translated where the library meets the driver
    (``celery_pglock.store._failures``): its kind is its class, its message says what to do, and
    the password is never in it. ``sqlstate``: the server's code, when it sent one;
    ``cause``: the driver's class and first line (``AdminShutdown: terminating …``)."""

    sqlstate: str | None = None
    cause: str = ""


class DatabaseUnavailable(DatabaseError):
    """PostgreSQL could not be reached or refused the connection (password never shown)."""


class ServerFull(DatabaseUnavailable):
    """PostgreSQL has no connection slot left for us (``too many clients``, the slots
    reserved for superusers, a role's connection limit, a pooler's ``max_client_conn``, or
    the headroom the library leaves to other clients): a process holding connections
    waits for one of its own instead."""


class SessionGone(DatabaseUnavailable):
    """An established session ended (the server was restarted or failed over, a DBA or a
    lease ended it, the network cut it): the advisory locks it held are gone with it."""


class DatabaseMisconfigured(DatabaseUnavailable, ConfigurationError):
    """PostgreSQL answered, and refused for a reason that waiting does not cure: wrong
    credentials, an unknown database or role, missing privileges, a read-only server.

    A ``DatabaseUnavailable`` where it happens at run time (a task retries it as it retries
    an outage, giving an operator time to fix it); a ``ConfigurationError`` at start-up,
    where a process stops on it at once, naming the fix (``celery_pglock._startup``).
    """


class ReadOnlyServer(DatabaseMisconfigured):
    """The server takes no writes: a standby, or a primary demoted by a failover."""


class StatementFailed(DatabaseError):
    """A statement failed on a live session for a reason of its own (a privilege, an
    aborted transaction): the session, and its locks, live on."""


class WaitEnded(StatementFailed):
    """A wait in the server's lock queue ran out (``lock_timeout``, ``statement_timeout``)."""


class SchemaMissing(ConfigurationError):
    """The tables are missing and ``pglock_auto_migrate`` is off."""


class LockLost(PgLockError):
    """The holder's lock was taken away (lease expired, session terminated)."""


class StaleToken(PgLockError):
    """A write carried a fencing token older than one already accepted for the resource.

    The holder that got this was superseded: a newer holder already wrote.
    """

    def __init__(self, resource: str, token: int, newest: int | None = None) -> None:
        self.resource = resource
        self.token = token
        self.newest = newest
        # args are the constructor's, so pickling and Celery's result backends (which
        # rebuild an exception as ``cls(*args)``) give back a StaleToken, not a PgLockError.
        super().__init__(resource, token, newest)

    def __str__(self) -> str:
        newer = f" (newest accepted: {self.newest})" if self.newest is not None else ""
        return (
            f"fencing token {self.token} for {self.resource!r} is stale{newer}: a newer lock "
            "holder already wrote; abandon this write"
        )


class TaskSkipped(PgLockError):
    """Raised inside a task body to skip the run; reported like a duplicate skip.

    ``reason`` is a short machine-readable word; ``meta`` extra detail for the result.
    """

    def __init__(self, reason: str = "skipped", **meta: Any) -> None:
        self.reason = reason
        self.meta = meta
        super().__init__(f"task skipped: {reason}")
