"""The server sessions a run's lock lives on, as the code above the store sees them.

A run's claim, skip and release are statements on the one server session that holds (or
tried) its lock: ``LockSession`` runs them by name and gives a dict row back, or one of
the library's errors, never the driver's; it also says what the lock's protocol asks of
a session (is a transaction open, is another thread's statement in flight, does it still
answer). ``LockSessions`` is where a ``Database`` gets them: taken from its pool and given
back (``clean``: our release already freed the locks), parked while an unwaited reply is
on its way, or opened fresh when the pooled ones may all be broken (a server restart).

``DriverSession`` is the real one, on a psycopg connection; the in-memory twin
(``celery_pglock.store._memory_sessions``) keeps advisory locks, tokens and leases by a
clock the test controls, so that the run lifecycle is unit-tested without a server.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from psycopg.rows import dict_row

from celery_pglock._config import Settings
from celery_pglock._values import Scope
from celery_pglock.store import _unwaited as unwaited
from celery_pglock.store._connections import close_quietly, connect, in_transaction, ping
from celery_pglock.store._driver import Connection
from celery_pglock.store._failures import boundary
from celery_pglock.store.statements import Statements

Row = dict[str, Any]
Params = Mapping[str, Any]


class LockSession(Protocol):
    """One server session a lock lives on (or is tried on)."""

    @property
    def driver(self) -> Connection:
        """The driver's connection of the session, for a run's body (the twin has none)."""

    @property
    def closed(self) -> bool:
        """Whether the session is known to have ended (closed, or its connection broke)."""

    def row(self, name: str, params: Params | None = None, *, outage: bool = False) -> Row | None:
        """The first row of statement ``name``, None when it returns none. ``outage``:
        any failure is taken for an outage or a misconfiguration (as while connecting),
        never for the statement's own: where a failure must be retried, not raised."""

    def use_scope(self, scope: Scope) -> None:
        """Statements run in autocommit (``session``) or in one transaction (``transaction``)."""

    def in_transaction(self) -> bool:
        """Whether the session is not idle: in a transaction, a failed one, or unknown."""

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def send_unwaited(self, name: str, params: Sequence[str | None], timeout: float) -> bool:
        """Send statement ``name`` ($1, $2… parameters) without waiting for its reply;
        False (nothing sent) when the session is not idle or the server spoke unasked."""

    def ping(self) -> None:
        """One round trip: ``SessionGone`` when the server ended the session."""

    def busy(self) -> bool:
        """Whether another thread's statement is in flight on the session."""

    def close(self) -> None:
        """End the session: the server frees whatever it held."""


class LockSessions(Protocol):
    """Where a database's lock sessions come from and go back to."""

    def take(self) -> LockSession:
        """A session for one locked run (from the pool)."""

    def give_back(self, session: LockSession, *, clean: bool) -> bool:
        """Return ``session``; ``clean``: our release statement already freed its locks.
        True if it was still usable, False if it was broken (and is forgotten)."""

    def park(self, session: LockSession) -> None:
        """Give back ``session`` while the reply to its unwaited statement is on its way."""

    def fresh(self) -> AbstractContextManager[LockSession]:
        """A new session of its own, ended afterwards: the pooled ones may all be broken."""

    def statements(self) -> AbstractContextManager[Statements]:
        """Named statements, no lock, on a pooled session given back afterwards."""


class DriverSession:
    """``LockSession`` on a psycopg connection of ``settings``."""

    def __init__(self, conn: Connection, settings: Settings) -> None:
        self.conn = conn
        self._settings = settings

    def __repr__(self) -> str:
        return f"<DriverSession {self._settings.tables.schema}>"

    @property
    def driver(self) -> Connection:
        return self.conn

    @property
    def closed(self) -> bool:
        return self.conn.closed

    def row(self, name: str, params: Params | None = None, *, outage: bool = False) -> Row | None:
        query = self._settings.tables.query(name)
        judged = None if outage else self.conn
        with boundary(self._settings, judged), self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(query, params)
            return cur.fetchone() if cur.description is not None else None

    def use_scope(self, scope: Scope) -> None:
        autocommit = scope == "session"
        if self.conn.autocommit != autocommit:  # a waited one is in its transaction already
            with boundary(self._settings, self.conn):
                self.conn.autocommit = autocommit

    def in_transaction(self) -> bool:
        return in_transaction(self.conn)

    def commit(self) -> None:
        with boundary(self._settings, self.conn):
            self.conn.commit()

    def rollback(self) -> None:
        with boundary(self._settings, self.conn):
            self.conn.rollback()

    def send_unwaited(self, name: str, params: Sequence[str | None], timeout: float) -> bool:
        conn = self.conn
        if conn.closed or in_transaction(conn) or not unwaited.quiet(conn):
            return False  # a transaction left open, or the server spoke (ended it?)
        with boundary(self._settings, conn):
            unwaited.send(conn, self._settings.tables.query(name), params, timeout)
        return True

    def ping(self) -> None:
        ping(self.conn)

    def busy(self) -> bool:
        if not self.conn.lock.acquire(blocking=False):
            return True
        self.conn.lock.release()
        return False

    def close(self) -> None:
        close_quietly(self.conn)


@contextmanager
def fresh_session(settings: Settings) -> Iterator[DriverSession]:
    """A ``DriverSession`` on a new connection of ``settings``, closed afterwards."""
    with connect(settings) as conn:
        yield DriverSession(conn, settings)
