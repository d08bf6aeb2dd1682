"""The beat leader election's own server session (``celery_pglock.beat._leader``).

A standby waits in the leader lock's queue on a session of its own, which then holds the
lock for as long as it leads: never pooled, labelled as a standby (then as the leader),
its statements ended soon after the process dies (a dead standby must leave the queue at
once), and its pings to a partitioned server failing within the lease, not after TCP's
minutes. Beat's claims run on it while it leads (``statements``), so that a replica whose
session was ended cannot claim, and so cannot send.
"""

from __future__ import annotations

from celery_pglock._config import Settings
from celery_pglock.store._connections import (
    LEASE_MIN_SERVER_VERSION,
    PREPARE_THRESHOLD,
    application_name,
    cancel_quietly,
    close_quietly,
    connect,
    watch_client,
)
from celery_pglock.store._failures import boundary
from celery_pglock.store._lock_sessions import DriverSession
from celery_pglock.store.statements import OnConnection


class LeaderSession(DriverSession):
    """``LockSession`` of a beat replica's election, on a connection of its own."""

    @classmethod
    def open(cls, settings: Settings, lease_seconds: float) -> LeaderSession:
        """A new session for a standby of ``settings`` whose lease is ``lease_seconds``."""
        conn = connect(
            settings,
            application_name=application_name(" beat standby"),
            tcp_user_timeout=round(lease_seconds * 1000),
            prepare_threshold=PREPARE_THRESHOLD,  # never behind a transaction pooler
        )
        try:
            with boundary(settings, conn):
                watch_client(conn)
        except BaseException:
            close_quietly(conn)
            raise
        return cls(conn, settings)

    @property
    def lease_supported(self) -> bool:
        """Whether the server ends an idle session by itself (PostgreSQL 14 and later)."""
        return self.conn.info.server_version >= LEASE_MIN_SERVER_VERSION

    def statements(self) -> OnConnection:
        """Named statements on this session (beat's claims while it leads)."""
        return OnConnection(self.conn, self._settings.tables, self._settings)

    def cancel(self) -> None:
        """End the wait in the lock queue, from another thread."""
        cancel_quietly(self.conn)
