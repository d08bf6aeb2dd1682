"""Connections: one pool per process (created after fork), schema creation, error translation.

A connection inherited across ``fork()`` still points at the parent's server session;
closing it in the child would end that session and silently free the parent's advisory
locks. So pools are never shared across processes: after a fork the child abandons the
inherited pools (kept referenced, never closed or finalized) and builds its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import waiting

from celery_pglock._config import Settings
from celery_pglock.errors import ConfigurationError, DatabaseError
from celery_pglock.schema import statement
from celery_pglock.store import _admission as admission
from celery_pglock.store import _unwaited as unwaited
from celery_pglock.store._connections import (
    FIX_BACKEND,
    LEASE_MIN_SERVER_VERSION,
    check_writable,
    connect,
    in_transaction,
    pooler_message,
    show_setting,
    transaction_pooled,
    watch_client,
)
from celery_pglock.store._driver import Connection
from celery_pglock.store._failover import Recall
from celery_pglock.store._failures import boundary
from celery_pglock.store._lock_sessions import (
    DriverSession,
    LockSession,
    LockSessions,
    fresh_session,
)
from celery_pglock.store._migrations import ensure_schema
from celery_pglock.store._pool import Pool
from celery_pglock.store.statements import OnConnection, Statements

logger = logging.getLogger("celery_pglock")

IDLE_SETTINGS = ("idle_session_timeout", "idle_in_transaction_session_timeout")

DEFAULT_POOL_SIZE = 4  # pglock_pool_size "auto" where tasks do not run as threads/greenlets

# By settings and whether connections are kept (see ``serve_tasks``).
_pools: dict[tuple[Settings, bool], Database] = {}
_abandoned: list[Database] = []  # inherited across fork: must never be closed here
_pools_lock = threading.Lock()
# pglock_pool_size "auto" in a worker whose tasks run as threads or greenlets of this
# process: its concurrency, plus one. Set at worker start-up, forgotten in a forked child.
_worker_pool_size: int | None = None
_serving = False  # see serve_tasks
# DSNs found to go through a transaction pooler, kept for the process and the children it
# forks afterwards (a prefork pool's replacement children; its first ones fork before the
# worker's start-up check), whose own check may miss it while their siblings start at once.
_pooled_dsns: set[str] = set()


def check_server(settings: Settings) -> bool:
    """What a worker or beat checks as it starts: the server takes writes and has our
    tables (created when allowed); whether a transaction pooler stands in between.

    Raises ``DatabaseUnavailable`` for an outage, a ``ConfigurationError`` for what to fix.
    """
    with connect(settings) as conn, boundary(settings):
        check_writable(conn, settings)
        ensure_schema(conn, settings.tables, auto_migrate=settings.auto_migrate)
        return _pooler_checked(conn, settings)


def _pooler_checked(conn: Connection, settings: Settings) -> bool:
    """Whether ``settings.dsn`` goes through a transaction pooler: known already in this
    process (or its parent), else checked on ``conn`` (and remembered)."""
    if settings.dsn in _pooled_dsns:
        return True
    pooled = transaction_pooled(conn, settings)
    if pooled:
        _pooled_dsns.add(settings.dsn)
    return pooled


def chosen_backend(settings: Settings, pooled: bool) -> tuple[str, str]:
    """How session-scope locks and beat's leadership are held for ``settings`` ("advisory"
    or "rows"), and why, as start-up lines and ``status`` say it; ``pooled``: a
    transaction pooler stands in between (``check_server``)."""
    if settings.lock_backend != "auto":
        return settings.lock_backend, f"pglock_lock_backend = {settings.lock_backend!r}"
    if pooled:
        return "rows", "a transaction pooler stands between this process and PostgreSQL"
    return "advisory", "no transaction pooler between this process and PostgreSQL"


def lock_backend(settings: Settings) -> tuple[str, str]:
    """``chosen_backend`` for ``settings``, the pooler checked on a connection of its own
    once per process (as ``celery pglock status`` and the dashboard say it for the app's
    DSN; the dashboard asks at every page)."""
    found = _backends.get(settings)
    if found is None:
        with connect(settings) as conn, boundary(settings):
            found = _backends[settings] = chosen_backend(settings, _pooler_checked(conn, settings))
    return found


_backends: dict[Settings, tuple[str, str]] = {}


def pool_size(settings: Settings) -> int:
    """How many connections this process's pool for ``settings`` may open."""
    if settings.pool_size is not None:
        return settings.pool_size
    return _worker_pool_size or DEFAULT_POOL_SIZE


def size_for_worker(settings: Settings, concurrency: int | None) -> int:
    """Size this process's "auto" pools for ``concurrency`` tasks running at once in it
    (a threads, gevent or eventlet worker; None: any other) and return the pool size.

    One connection per task that may hold a lock, plus one: a locked task's body may
    publish a task checked on enqueue (``pglock_check_on_enqueue``), a look-up that needs
    a second connection while every task holds its own.
    """
    global _worker_pool_size  # noqa: PLW0603 - one process-wide setting, reset after fork
    with _pools_lock:
        _worker_pool_size = None if concurrency is None else max(1, concurrency) + 1
        for db in _pools.values():  # a pool opened before start-up (rare) follows too
            if db.pid == os.getpid() and db.keep_connections and db.settings.pool_size is None:
                db.pool.resize(pool_size(db.settings))
    return pool_size(settings)


def serve_tasks() -> None:
    """This process runs a worker's tasks (set at start-up and in each prefork child).

    Only then do locked tasks keep connections between runs (a pool) and the heartbeat
    thread between leases. Anywhere else (eager and direct calls in a test suite, a
    script) a locked run opens its own connection and closes it afterwards: no thread and
    no server session of ours outlives the call (a test database can then be dropped).
    """
    global _serving  # noqa: PLW0603 - one process-wide fact, inherited by forked children
    _serving = True


def serving_tasks() -> bool:
    return _serving


def waits_block_greenlets() -> bool:
    """Whether psycopg waits for replies in C (``wait_c``), which yields to no greenlet.

    psycopg avoids it once gevent has patched ``select``, but does not detect eventlet:
    under ``-P eventlet`` each statement then pauses every greenlet of the process, the
    lease heartbeats included, until its reply. ``PSYCOPG_WAIT_FUNC=wait_select`` in the
    environment makes psycopg wait through ``select``, which eventlet makes cooperative.
    """
    return getattr(waiting.wait, "__name__", "") == "wait_c"


class Database:
    """This process's pool for one ``Settings``, plus what we learned about the server.

    ``keep_connections=False``: no pool; each ``getconn`` opens a connection that
    ``putconn`` closes (locked runs outside a worker, see ``serve_tasks``).
    ``lock_sessions``: where the sessions of locked runs come from (default: the pool's
    connections; a unit test passes the in-memory twin's).
    """

    def __init__(
        self,
        settings: Settings,
        *,
        keep_connections: bool = True,
        lock_sessions: LockSessions | None = None,
    ) -> None:
        self.settings = settings
        self.keep_connections = keep_connections
        self.tables = settings.tables
        self.pid = os.getpid()
        self._schema_ready = False
        self._schema_lock = threading.Lock()
        self.server_version = 0
        self.transaction_pooled = False  # behind PgBouncer pool_mode=transaction (or alike)
        # What the role/database configured (a DBA may set these); restored after a run.
        self.idle_defaults = dict.fromkeys(IDLE_SETTINGS, "0")
        self.recall = Recall()  # for after a failover (celery_pglock.store._failover)
        self.pool = Pool(
            self._open_connection,
            max_size=pool_size(settings),
            idle_timeout=settings.idle_timeout,
            timeout=settings.connect_timeout,
            name=f"celery-pglock-{os.getpid()}",
        )
        self.lock_sessions: LockSessions = lock_sessions or PooledSessions(self)

    @property
    def shares_sessions(self) -> bool:
        """Whether session-scope locks share one session per process (``shared``): in a
        worker whose tasks run as threads or greenlets, unless ``pglock_shared_sessions``
        is off."""
        return self.keep_connections and self.settings.shared_sessions and bool(_worker_pool_size)

    @property
    def on_rows(self) -> bool:
        """Whether session-scope locks are held on rows (``chosen_backend``)."""
        return chosen_backend(self.settings, self.transaction_pooled)[0] == "rows"

    @property
    def lease_supported(self) -> bool:
        return self.server_version >= LEASE_MIN_SERVER_VERSION

    def open(self) -> None:
        """Open the pool and make sure the schema exists; raise a clear error if we cannot."""
        with connect(self.settings) as conn, boundary(self.settings):
            check_writable(conn, self.settings)
            self._learn_server(conn)
            self.ensure_schema(conn)
            self._check_timeline(conn)
            self.transaction_pooled = _pooler_checked(conn, self.settings)
        if not self.lease_supported:
            logger.warning(
                "PostgreSQL %d has no idle_session_timeout (needs 14): session-scope locks "
                "of frozen holders are kept until the holder dies; the lease is unavailable",
                self.server_version // 10000,
                extra={"action": "pglock_lease_unavailable"},
            )

    def getconn(self) -> Connection:
        """A connection for one locked execution; give it back with ``putconn``."""
        if not self.keep_connections:
            return self._connect_once()
        return self.pool.getconn()

    def _connect_once(self) -> Connection:
        conn = connect(self.settings)
        try:
            with boundary(self.settings):
                self._configure(conn)
        except DatabaseError:
            conn.close()
            raise
        return conn

    def _open_connection(self) -> Connection:
        """A new connection for the pool: refused (``ServerFull``) when fewer than
        ``pglock_spare_connections`` server slots remain (the pool then waits for one of
        this process's own connections, or, holding none, tries again a while).

        Through a pooler (or a proxy) the server's slots are not counted: the connection
        may be one the pooler already had, and the pooler's own limits decide; its refusal
        beyond ``max_client_conn`` is a ``ServerFull`` like the server's."""
        conn = self._connect_once()
        try:
            admission.check(conn, self.settings, self.pool.admission)
        except BaseException:
            conn.close()
            raise
        return conn

    def putconn(self, conn: Connection, *, clean: bool) -> bool:
        """Return ``conn``; ``clean`` says our release statement already freed its locks.
        True if the connection was still usable (its session alive), False if broken."""
        if not self.keep_connections:
            usable = not (conn.closed or conn.broken)
            conn.close()  # the session ends: the server frees whatever it still held
            return usable
        if not clean or in_transaction(conn):
            self._reset(conn)  # closes it if it cannot be reset
        if conn.closed:
            self.pool.putconn(conn)  # forgotten: its place goes to the next caller
            return False
        self.pool.putconn(conn)
        return True

    def park_unwaited(self, conn: Connection) -> None:
        """Give back ``conn`` while the reply to its last statement is on its way."""
        if not self.keep_connections:
            with contextlib.suppress(psycopg.Error):  # else the session's end frees the lock
                unwaited.read_reply(conn, self.settings.connect_timeout)
            conn.close()
            return
        self.pool.putconn(conn, pending=True)

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A connection for plain statements (no locks, autocommit), given back afterwards;
        driver errors raised inside become the library's (``failures``)."""
        conn = self.getconn()
        try:
            with boundary(self.settings):  # a task retries DatabaseUnavailable
                if not conn.autocommit:  # a transaction-scope run gave it back idle
                    conn.autocommit = True
                yield conn
        finally:
            self.putconn(conn, clean=True)  # reset anyway if it is not idle

    def statements(self) -> contextlib.AbstractContextManager[Statements]:
        """Named statements on a pooled session (no lock), given back afterwards."""
        return self.lock_sessions.statements()

    def ensure_schema(self, conn: Connection) -> None:
        if self._schema_ready:
            return
        with self._schema_lock:
            if not self._schema_ready:
                ensure_schema(conn, self.tables, auto_migrate=self.settings.auto_migrate)
                self._schema_ready = True

    def close(self) -> None:
        if self.pid == os.getpid():
            self.pool.close()

    def _configure(self, conn: Connection) -> None:
        self.server_version = conn.info.server_version
        self._check_timeline(conn)
        if self.transaction_pooled:  # a statement prepared on one server connection is
            conn.prepare_threshold = None  # unknown to the next one the pooler picks
        else:
            watch_client(conn)

    def _check_timeline(self, conn: Connection) -> None:
        """A new connection: after a failover, check the successes this process recalls."""
        try:
            self.recall.connected(conn, self.tables)
        except psycopg.Error as exc:  # never worth losing the connection for
            logger.debug("timeline check failed: %s", exc, extra={"action": "pglock_timeline"})

    def check_session_scope(self) -> None:
        """Refuse session-scope advisory locks through a transaction pooler (they would
        leak): only where ``pglock_lock_backend = "advisory"`` asked for them."""
        if self.transaction_pooled and not self.on_rows:
            what = "session-scope advisory locks"
            raise ConfigurationError(pooler_message(self.settings, what, FIX_BACKEND))

    def _learn_server(self, conn: Connection) -> None:
        self.server_version = conn.info.server_version
        for name in self.idle_defaults:
            if name == "idle_session_timeout" and not self.lease_supported:
                continue
            self.idle_defaults[name] = show_setting(conn, name) or "0"

    def _reset(self, conn: Connection) -> None:
        # The release statement already unlocked and disarmed the lease; only a connection
        # returned on an error path needs the full reset (one extra round trip). One that
        # cannot be reset is closed: the pool then replaces it.
        try:
            if in_transaction(conn):
                conn.rollback()
            conn.autocommit = True  # else the reset opens a transaction
            reset = "reset_connection" if self.lease_supported else "reset_connection_pre14"
            conn.execute(statement(reset))
        except psycopg.Error:
            conn.close()


class PooledSessions:
    """A ``Database``'s lock sessions: its pool's connections (``LockSessions``)."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def take(self) -> LockSession:
        return DriverSession(self._db.getconn(), self._db.settings)

    def give_back(self, session: LockSession, *, clean: bool) -> bool:
        return self._db.putconn(session.driver, clean=clean)

    def park(self, session: LockSession) -> None:
        self._db.park_unwaited(session.driver)

    def fresh(self) -> contextlib.AbstractContextManager[LockSession]:
        return fresh_session(self._db.settings)

    @contextmanager
    def statements(self) -> Iterator[Statements]:
        with self._db.connection() as conn:
            yield OnConnection(conn, self._db.tables, self._db.settings)


def database(settings: Settings, *, keep_connections: bool = True) -> Database:
    """This process's ``Database`` for ``settings``, opened on first use."""
    key = (settings, keep_connections)
    found = _pools.get(key)
    if found is not None and found.pid == os.getpid():
        return found
    with _pools_lock:
        found = _pools.get(key)
        if found is None or found.pid != os.getpid():
            found = Database(settings, keep_connections=keep_connections)
            found.open()
            _pools[key] = found
        return found


def close_all() -> None:
    """Close this process's pools (worker_process_shutdown, tests)."""
    with _pools_lock:
        for db in list(_pools.values()):
            db.close()
        _pools.clear()


def _forget_inherited_pools() -> None:
    # Runs in the child right after fork: keep the parent's pools alive but unused. A
    # prefork child (or beat forked by `worker -B`) runs one task at a time: it does not
    # take the size its parent set for tasks running as threads or greenlets. The lock is
    # a new one: another thread of the parent may have held it at the fork, and that
    # thread does not exist here to let it go.
    global _worker_pool_size, _pools_lock  # noqa: PLW0603
    _pools_lock = threading.Lock()
    _abandoned.extend(_pools.values())
    _pools.clear()
    _worker_pool_size = None


os.register_at_fork(after_in_child=_forget_inherited_pools)
