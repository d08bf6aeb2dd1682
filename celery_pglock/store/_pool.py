"""A process's connections to one server: how many it may hold, who gets the next one
freed, and when idle ones are given back to the server.

- At most ``max_size`` connections (open, being opened, lent or idle). A caller finding
  none idle and the cap reached waits; each connection given back goes to the longest
  waiter, in order. A waiter gives up only after ``timeout`` seconds in which no
  connection of this process was given back: while runs end, nobody burns a retry.
- The server full (``too many clients``, a role's connection limit, a pooler's
  ``max_client_conn``, or fewer free slots left than the spare ones) is a wait, not a
  failure, while this process holds connections that will come back; how many it opens at
  once and when it opens none for a moment is ``admission``'s. With none to come back it
  tries again until ``timeout``.
- Idle connections are handed out last in, first out (the one used last has warm caches
  on both sides), and closed after ``idle_timeout`` seconds unused by one thread per pool,
  which ends when nothing is idle. An idle connection holds no lock: its run's release or
  the reset freed them before it came back.
- A connection whose last statement was sent without waiting for the reply
  (``unwaited``) is idle too; its reply is read before it is handed out or closed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import psycopg

from celery_pglock.errors import DatabaseUnavailable, ServerFull
from celery_pglock.store import _unwaited as unwaited
from celery_pglock.store._admission import RETRY_FULL, Admission
from celery_pglock.store._driver import Connection

logger = logging.getLogger("celery_pglock")


class _Waiter:
    __slots__ = ("conn", "event", "may_open", "pending")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.conn: Connection | None = None
        self.pending = False  # the connection handed over has a reply to read
        self.may_open = False  # handed a free place under the cap instead of a connection


class Pool:
    """This process's connections for one ``Database`` (see the module's docstring)."""

    def __init__(
        self,
        connect: Callable[[], Connection],
        *,
        max_size: int,
        idle_timeout: float | None,
        timeout: float,
        name: str,
    ) -> None:
        self._connect = connect  # raises ServerFull, DatabaseUnavailable, ...
        self.max_size = max_size
        self.idle_timeout = idle_timeout
        self.timeout = timeout
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[tuple[Connection, float, bool]] = []  # (conn, since, reply pending)
        self._size = 0  # connections counted against the cap, whatever their state
        self._waiters: deque[_Waiter] = deque()
        self._given_back = time.monotonic()  # last time a connection came back
        self.admission = Admission(self._lock)  # how many may be opened now
        self._sweeper: threading.Thread | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<Pool {self.name} size={self._size}/{self.max_size} idle={len(self._idle)}>"

    @property
    def size(self) -> int:
        """Connections this process holds now (lent, idle or being opened)."""
        return self._size

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def waiters(self) -> int:
        return len(self._waiters)

    def resize(self, max_size: int) -> None:
        with self._lock:
            self.max_size = max_size

    def getconn(self) -> Connection:
        """An idle connection, a new one, or the next one given back, in turn."""
        front = False  # refused by a full server: first in line again
        while True:
            waiter: _Waiter | None = None
            conn: Connection | None = None
            pending = False
            with self._lock:
                if self._closed:
                    raise DatabaseUnavailable(f"connection pool {self.name} is closed")
                if self._idle and not self._waiters:
                    conn, _, pending = self._idle.pop()
                elif self._may_open() and not self._waiters:
                    self._reserve()
                    conn, pending = None, False
                else:
                    waiter = _Waiter()
                    if front:
                        self._waiters.appendleft(waiter)
                    else:
                        self._waiters.append(waiter)
            if waiter is not None:
                conn = self._wait(waiter)
                pending = waiter.pending
            if conn is None:  # a place under the cap: open a connection in it
                conn = self._open_counted()
                if conn is None:
                    front = True
                    continue
                return conn
            if not pending or self._read_reply(conn):
                return conn

    def putconn(self, conn: Connection, *, pending: bool = False) -> None:
        """Give ``conn`` back: to the longest waiter, else idle. A closed one is forgotten
        (its place goes to the longest waiter). ``pending``: its last reply is unread."""
        if pending and self._waiters:  # read here rather than by the waiter handed it
            if not self._read_reply(conn):
                return  # closed and forgotten
            pending = False
        with self._lock:
            self._given_back = time.monotonic()
            if conn.closed or self._closed:
                self._forget()
            elif self._waiters:
                waiter = self._waiters.popleft()
                waiter.conn, waiter.pending = conn, pending
                waiter.event.set()
                return
            else:
                self._idle.append((conn, time.monotonic(), pending))
                self._start_sweeper()
                return
        if self._closed:
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._size -= len(idle)
            waiters, self._waiters = list(self._waiters), deque()
        for waiter in waiters:
            waiter.event.set()
        for conn, _, _ in idle:
            conn.close()

    # -- inside --------------------------------------------------------------------------

    def _may_open(self) -> bool:
        """Whether a caller may open a connection now: under the cap, and as
        ``admission`` allows."""
        return self._size < self.max_size and self.admission.may_open(self._size)

    def _reserve(self) -> None:
        """Count a connection about to be opened (with the lock held)."""
        self._size += 1
        self.admission.opening += 1

    def _offer_place(self) -> None:
        """The longest waiter opens a connection, if one may be opened (lock held)."""
        if self._waiters and self._may_open():
            waiter = self._waiters.popleft()
            waiter.may_open = True
            self._reserve()
            waiter.event.set()

    def _wait(self, waiter: _Waiter) -> Connection | None:
        """Wait to be handed a connection (or a place to open one); ``DatabaseUnavailable``
        after ``timeout`` without any connection of this process given back."""
        started = time.monotonic()
        while True:
            with self._lock:
                quiet_since = max(started, self._given_back)
            remaining = quiet_since + self.timeout - time.monotonic()
            if waiter.event.wait(min(max(0.0, remaining), RETRY_FULL * 5)):
                if waiter.conn is None and not waiter.may_open:
                    raise DatabaseUnavailable(f"connection pool {self.name} is closed")
                return waiter.conn
            with self._lock:
                if waiter.event.is_set():
                    continue  # handed something just now
                # The server's pause ended, or a place freed: the longest waiter opens one.
                if self._waiters[0] is waiter and self._may_open():
                    self._waiters.remove(waiter)
                    self._reserve()
                    return None
                if max(started, self._given_back) + self.timeout > time.monotonic():
                    continue
                self._waiters.remove(waiter)
                raise self._timed_out()

    def _timed_out(self) -> DatabaseUnavailable:
        refusal = self.admission.refusal_within(self.timeout)
        return refusal or DatabaseUnavailable(
            f"no PostgreSQL connection within {self.timeout:.1f} s: all {self.max_size} "
            "connections of this process are in use by locked tasks (pglock_pool_size); "
            "raise pglock_pool_size to run more of them at once"
        )

    def _open_counted(self) -> Connection | None:
        """Open the connection whose place is already counted; None: the server is full
        and this process holds others, so wait for one of them (``getconn`` loops)."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                conn = self._connect()
            except ServerFull as full:
                with self._lock:
                    self.admission.refused(full)
                    if self._size > 1 or time.monotonic() >= deadline:
                        self.admission.opening -= 1
                        self._forget()
                        if self._size:  # others of ours will come back: wait for them
                            return None
                        raise
                time.sleep(RETRY_FULL)  # holding none: try again
                continue
            except BaseException:
                with self._lock:
                    self.admission.opening -= 1
                    self._forget()
                raise
            with self._lock:
                self.admission.opening -= 1
                self._offer_place()
            return conn

    def _forget(self) -> None:
        """One connection less (closed); its place goes to a waiter. Lock held."""
        self._size -= 1
        self._offer_place()

    def _read_reply(self, conn: Connection) -> bool:
        try:
            unwaited.read_reply(conn, self.timeout)
        except psycopg.Error as exc:
            # Closing the connection ends its session, which frees any lock it still
            # held: only this connection is lost.
            logger.info(
                "connection replaced: the reply to its last statement failed: %s",
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                extra={"action": "pglock_unwaited_reply_failed"},
            )
            conn.close()
            with self._lock:
                self._forget()
            return False
        return True

    def _start_sweeper(self) -> None:
        """Called with the lock held, a connection just made idle."""
        if self.idle_timeout is None or self._sweeper is not None:
            return
        self._sweeper = threading.Thread(
            target=self._sweep, name=f"pglock-idle-{self.name}", daemon=True
        )
        self._sweeper.start()

    def _sweep(self) -> None:
        assert self.idle_timeout is not None
        while True:
            with self._lock:
                if not self._idle or self._closed:
                    self._sweeper = None
                    return
                now = time.monotonic()
                oldest = min(since for _, since, _ in self._idle)
                stale = [item for item in self._idle if now - item[1] >= self.idle_timeout]
                self._idle = [item for item in self._idle if now - item[1] < self.idle_timeout]
                self._size -= len(stale)
                wait = max(0.05, oldest + self.idle_timeout - now) if not stale else 0.0
            for conn, _, pending in stale:
                if pending:  # a failure is no matter: closed, its session ends, locks too
                    with contextlib.suppress(psycopg.Error):
                        unwaited.read_reply(conn, self.timeout)
                conn.close()
            if stale:
                logger.debug(
                    "closed %d idle connections of %s",
                    len(stale),
                    self.name,
                    extra={"action": "pglock_idle_closed"},
                )
            if wait:
                time.sleep(wait)
