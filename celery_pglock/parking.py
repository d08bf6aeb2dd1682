"""Connections a process keeps out of its pool between two locked runs.

psycopg_pool hands its idle connections out first in, first out: a prefork child with two
pooled connections alternates between two server processes, and each run then finds
cold caches on both sides (measured: 15% slower per run than one connection). So the
connection given back last is kept here and given out first. A connection whose last
statement was sent without waiting for the reply (``unwaited``) also waits here, however
many there are, until the reply is read: the pool would discard a busy connection.

A parked connection is invisible to a caller already blocked in the pool's ``getconn()``:
kept here it would wait out its whole timeout while connections are being freed. So the
callers waiting for the pool are counted, and while there is one, a connection given back
goes to the pool (its pending reply read first), which hands it to the longest waiter.
Counting and parking are decided under one lock, so no connection is parked unseen by a
caller that has just found the parking empty. A process running one task at a time never
has a waiter: its path is the one lock it always took.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from celery_pglock import unwaited

logger = logging.getLogger("celery_pglock")

Connection = psycopg.Connection[Any]


class Parking:
    """Last in, first out; at most one connection whose reply was already read."""

    def __init__(self, pool: ConnectionPool[Any], reply_timeout: float) -> None:
        self._pool = pool
        self._reply_timeout = reply_timeout
        self._lock = threading.Lock()
        self._parked: list[tuple[Connection, bool]] = []  # (connection, reply pending)
        self._waiters = 0  # callers between ``take`` returning None and ``stop_waiting``

    @property
    def waiters(self) -> int:
        return self._waiters

    def take(self) -> Connection | None:
        """The connection parked last, its reply read; None when none is parked.

        None makes the caller a waiter for the pool's ``getconn()`` until it calls
        ``stop_waiting``, whatever that gives it.
        """
        while True:
            with self._lock:
                if not self._parked:
                    self._waiters += 1
                    return None
                conn, pending = self._parked.pop()
            if not pending or self._read_reply(conn):
                return conn

    def stop_waiting(self) -> None:
        with self._lock:
            self._waiters -= 1

    def park(self, conn: Connection, *, pending: bool = False) -> None:
        """Keep ``conn`` for the next ``take``; a second idle one goes back to the pool, and
        so does every one while a caller waits for the pool."""
        with self._lock:
            if not self._waiters and (pending or all(waiting for _, waiting in self._parked)):
                self._parked.append((conn, pending))
                return
        # Outside the lock: reading a reply waits for the server.
        if not pending or self._read_reply(conn):
            self._pool.putconn(conn)

    def close(self) -> None:
        with self._lock:
            parked, self._parked = self._parked, []
        for conn, _ in parked:
            conn.close()
            self._pool.putconn(conn)  # the pool forgets a closed connection

    def _read_reply(self, conn: Connection) -> bool:
        try:
            unwaited.read_reply(conn, self._reply_timeout)
        except psycopg.Error as exc:
            # Closing the connection ends its session, which frees any lock it still
            # held: only this connection is lost.
            logger.info(
                "connection replaced: the reply to its last statement failed: %s",
                str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                extra={"action": "pglock_unwaited_reply_failed"},
            )
            conn.close()
            self._pool.putconn(conn)
            return False
        return True
