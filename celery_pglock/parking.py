"""Connections a process keeps out of its pool between two locked runs.

psycopg_pool hands its idle connections out first in, first out: a prefork child with two
pooled connections alternates between two server processes, and each run then finds
cold caches on both sides (measured: 15% slower per run than one connection). So the
connection given back last is kept here and given out first. A connection whose last
statement was sent without waiting for the reply (``unwaited``) also waits here, however
many there are, until the reply is read: the pool would discard a busy connection.
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

    def take(self) -> Connection | None:
        """The connection parked last, its reply read; None when none is parked."""
        while True:
            with self._lock:
                if not self._parked:
                    return None
                conn, pending = self._parked.pop()
            if not pending or self._read_reply(conn):
                return conn

    def park(self, conn: Connection, *, pending: bool = False) -> None:
        """Keep ``conn`` for the next ``take``; a second idle one goes back to the pool."""
        with self._lock:
            if pending or all(waiting for _, waiting in self._parked):
                self._parked.append((conn, pending))
                return
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
