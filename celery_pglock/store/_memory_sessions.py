"""The in-memory twin of a server and its lock sessions, for unit tests of the run
lifecycle (``locks``, ``runs``): claim, skip, settle, give back, lock lost.

``InMemoryServer`` is one server: its sessions, their advisory locks and the tables of
an ``InMemoryStatements`` (``memory``), with the lock statements' twins
(``memory_locks``). Its clock is the tables' clock, which the test moves: a session whose
lease is armed and that stays idle longer than it is ended by the server, as
``idle_session_timeout`` (or, in a transaction, ``idle_in_transaction_session_timeout``)
ends one, and every statement of any session looks at the clock first, as the server's
timers would have fired. ``terminate`` ends a session as ``pg_terminate_backend`` does.

The operator's statements on held locks (who holds one, end its session) have their twins
too (``memory_ops``), so that ``celery pglock release`` is unit-tested as well.

``in_memory_database`` gives a ``Database`` whose sessions are this server's (for locks,
and for plain statements: ``Database.statements``): the
code under test is the library's own, only the server is a twin. Single-threaded tests
are its use; one lock keeps a heartbeat thread from interleaving a statement. A
transaction has no isolation from other sessions, and its rollback puts back every table
as the transaction found it: tests run one transaction at a time. What it has no twin of
(waiting in a lock queue, a statement it does not know) raises ``NotImplementedError``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta

from celery_pglock._config import Settings
from celery_pglock._values import Scope
from celery_pglock.errors import PgLockError, SessionGone
from celery_pglock.store._database import Database
from celery_pglock.store._driver import Connection
from celery_pglock.store._lock_sessions import LockSession, Params, Row
from celery_pglock.store._memory import InMemoryStatements, Rows, stored
from celery_pglock.store._memory_locks import AdvisoryLocks, Caller, Key, LockStatements
from celery_pglock.store._memory_ops import OpsStatements
from celery_pglock.store._memory_waiting import WaitingStatements
from celery_pglock.store.statements import Statements

SERVER_VERSION = 150000  # PostgreSQL 15: the lease is supported
DEFAULT_IDLE = {"idle_session_timeout": "0", "idle_in_transaction_session_timeout": "0"}
IDLE_ENDED = "FATAL: terminating connection due to idle-session timeout"
TERMINATED = "FATAL: terminating connection due to administrator command"


class InMemoryServer:
    """Sessions, advisory locks and the library's tables, in memory."""

    def __init__(self, tables: InMemoryStatements | None = None) -> None:
        self.tables = tables or InMemoryStatements()
        self.locks = AdvisoryLocks()
        self.handlers = {
            **LockStatements(self.tables, self.locks, self._caller).handlers,
            **WaitingStatements(self.tables, self.locks).handlers,
            **OpsStatements(self.tables, self.locks, self._caller, self._terminate).handlers,
        }
        self.guard = threading.RLock()
        self._sessions: dict[int, InMemorySession] = {}
        self._pids = itertools.count(1001)

    def __repr__(self) -> str:
        return f"<InMemoryServer {len(self._sessions)} sessions>"

    def connect(self) -> InMemorySession:
        """A new session (a backend of its own)."""
        with self.guard:
            session = InMemorySession(self, next(self._pids))
            self._sessions[session.pid] = session
            return session

    def sessions(self) -> list[InMemorySession]:
        """The live sessions."""
        return list(self._sessions.values())

    def holds(self, session: InMemorySession, key: Key) -> bool:
        """Whether ``session`` holds lock ``key`` (``holds_lock``)."""
        return self.locks.holds(session.pid, key)

    def terminate(self, session: InMemorySession) -> None:
        """End ``session`` as ``pg_terminate_backend`` does (a test's own hand)."""
        with self.guard:
            self._terminate(session.pid)

    def end(self, session: InMemorySession, cause: str) -> None:
        """The session ends: its transaction rolls back and its locks are free."""
        if session.ended is not None:
            return
        session.finish_transaction(commit=False)
        session.ended = cause
        self.locks.drop(session.pid)
        self._sessions.pop(session.pid, None)

    def expire(self) -> None:
        """End every session idle for longer than its armed lease, by the clock."""
        now = self.tables.clock()
        for session in self.sessions():
            lease = session.idle_limit()
            if lease is not None and now - session.idle_since > lease:
                self.end(session, IDLE_ENDED)

    def _terminate(self, pid: int) -> bool:
        """``pg_terminate_backend``: True if session ``pid`` lived (it ends now)."""
        found = self._sessions.get(pid)
        if found is not None:
            self.end(found, TERMINATED)
        return found is not None

    def _caller(self, pid: int) -> Caller | None:
        found = self._sessions.get(pid)
        return found.caller if found is not None else None


class InMemorySession:
    """``LockSession`` of an ``InMemoryServer``."""

    def __init__(self, server: InMemoryServer, pid: int) -> None:
        self.server = server
        self.tables = server.tables.tables
        self.pid = pid
        self.caller = Caller(pid, settings=dict(DEFAULT_IDLE), backend_start=server.tables.clock())
        self.autocommit = True
        self.ended: str | None = None  # why the server ended it
        self.idle_since = server.tables.clock()
        self._restore: Rows | None = None  # in a transaction: the tables as it found them

    def __repr__(self) -> str:
        return f"<InMemorySession {self.pid}{' ended' if self.ended else ''}>"

    @property
    def driver(self) -> Connection:
        raise PgLockError("an in-memory session has no driver connection for a run's body")

    @property
    def closed(self) -> bool:
        return self.ended is not None

    def row(self, name: str, params: Params | None = None, *, outage: bool = False) -> Row | None:
        found = self.rows(name, params)
        return found[0] if found else None

    def rows(self, name: str, params: Params | None = None) -> list[Row]:
        with self.server.guard:
            self._answering()
            if not self.autocommit and self._restore is None:
                self._begin()
            handler = self.server.handlers.get(name)
            try:
                if handler is not None:
                    with self.server.tables.transaction():
                        return handler(self.caller, stored(params))
                if name == "wait_lock":
                    raise NotImplementedError("the in-memory server has no lock queue to wait in")
                return self.server.tables.rows(name, params)
            finally:
                self._answered()

    def run(self, name: str, params: Params | None = None) -> int:
        return len(self.rows(name, params))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """The statements inside commit together, or none of them does."""
        autocommit, self.autocommit = self.autocommit, False
        try:
            yield
        except BaseException:
            self.rollback()
            raise
        else:
            self.commit()
        finally:
            self.autocommit = autocommit

    def schema_version(self) -> int | None:
        return self.server.tables.schema_version()

    def use_scope(self, scope: Scope) -> None:
        self.autocommit = scope == "session"

    def in_transaction(self) -> bool:
        return self._restore is not None

    def commit(self) -> None:
        with self.server.guard:
            self._answering()
            self.finish_transaction(commit=True)
            self._answered()

    def rollback(self) -> None:
        with self.server.guard:
            self._answering()
            self.finish_transaction(commit=False)
            self._answered()

    def send_unwaited(self, name: str, params: Sequence[str | None], timeout: float) -> bool:
        if self.closed or self.in_transaction():
            return False
        self.rows(name, {str(place): value for place, value in enumerate(params, 1)})
        return True

    def ping(self) -> None:
        with self.server.guard:
            self._answering()
            self._answered()

    def busy(self) -> bool:
        return False

    def close(self) -> None:
        with self.server.guard:
            self.server.end(self, "closed by the client")

    # -- the server's side ----------------------------------------------------------------

    def idle_limit(self) -> timedelta | None:
        """The armed lease that ends this session while idle, None when none is."""
        if self._restore is not None:
            name = "idle_in_transaction_session_timeout"
            ms = self.caller.local.get(name, self.caller.settings[name])
        else:
            ms = self.caller.settings["idle_session_timeout"]
        return None if ms == "0" else timedelta(milliseconds=int(ms))

    def finish_transaction(self, *, commit: bool) -> None:
        """End the open transaction, if any: its locks and local settings with it."""
        if self._restore is None:
            return
        restore, self._restore = self._restore, None
        self.server.tables.end(None if commit else restore)
        self.server.locks.end_transaction(self.pid)
        self.caller.local.clear()
        self.caller.xact_start = None

    def reset(self) -> None:
        """What the pool's reset does to a session given back unclean."""
        with self.server.guard:
            self.finish_transaction(commit=False)
            self.server.locks.unlock_all(self.pid)
            self.caller.settings = dict(DEFAULT_IDLE)
            self.autocommit = True

    def _begin(self) -> None:
        self._restore = self.server.tables.begin()
        self.caller.xact_start = self.server.tables.now

    def _answering(self) -> None:
        self.server.expire()
        if self.ended is not None:
            error = SessionGone(f"the session with PostgreSQL (in memory) ended: {self.ended}")
            error.cause = f"AdminShutdown: {self.ended}"
            raise error

    def _answered(self) -> None:
        self.idle_since = self.server.tables.clock()
        self.caller.state_change = self.idle_since


class InMemoryLockSessions:
    """``LockSessions`` on an ``InMemoryServer``: a pool of its sessions."""

    def __init__(self, server: InMemoryServer) -> None:
        self.server = server
        self.idle: list[InMemorySession] = []
        self.taken: list[InMemorySession] = []  # out of the pool now

    def take(self) -> LockSession:
        return self._checkout()

    def give_back(self, session: LockSession, *, clean: bool) -> bool:
        assert isinstance(session, InMemorySession), session
        self.taken.remove(session)
        if session.closed:
            return False  # forgotten: its place goes to the next taker
        if not clean or session.in_transaction():
            session.reset()
        self.idle.append(session)
        return True

    def park(self, session: LockSession) -> None:
        self.give_back(session, clean=True)  # its reply was read at once

    @contextmanager
    def statements(self) -> Iterator[Statements]:
        session = self._checkout()
        try:
            yield session
        finally:
            self.give_back(session, clean=True)

    def _checkout(self) -> InMemorySession:
        session = self.idle.pop() if self.idle else self.server.connect()
        self.taken.append(session)
        return session

    @contextmanager
    def fresh(self) -> Iterator[LockSession]:
        session = self.server.connect()
        try:
            yield session
        finally:
            session.close()


def in_memory_database(
    server: InMemoryServer | None = None, settings: Settings | None = None
) -> Database:
    """A ``Database`` whose lock sessions are ``server``'s (default: a new one)."""
    server = server or InMemoryServer()
    tables = server.tables.tables
    settings = settings or Settings(
        dsn="postgresql://in-memory/twin", schema=tables.schema, table_prefix=tables.prefix
    )
    db = Database(settings, lock_sessions=InMemoryLockSessions(server))
    db.server_version = SERVER_VERSION
    return db
