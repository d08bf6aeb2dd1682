"""Beat leader election on a session advisory lock.

The leader holds ``pg_advisory_lock(key)`` on a dedicated connection. Standbys block in
the same call on their own connection, so the server grants the lock to one of them the
moment the leader's session ends (crash, SIGKILL, shutdown): failover takes milliseconds,
not a TTL. A frozen or partitioned leader goes idle, the server ends its session after
the lease (``idle_session_timeout``), and a standby takes over; when the old leader wakes,
its next use of the connection fails and it steps down before sending anything.
"""

from __future__ import annotations

import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from celery_pglock import signals
from celery_pglock._config import Settings
from celery_pglock._heartbeat import unwatch, watch
from celery_pglock._locks import lease_ms
from celery_pglock._protocol import Claim, Lease
from celery_pglock.errors import PgLockError
from celery_pglock.store._connections import HOSTNAME, application_name
from celery_pglock.store._driver import Connection
from celery_pglock.store._leader_session import LeaderSession
from celery_pglock.store.statements import Row, Statements

logger = logging.getLogger("celery_pglock.beat")

RETRY_DELAY = 1.0
ROW_LEADER_POLL = 0.25  # seconds between looks at a leader elected on rows, until it expired


class Competitor(ABC):
    """What every way of electing beat's leader shares: the leader lock's claim, the
    thread that competes (``_run``), and telling alike that this replica now leads (or no
    longer does), and once per outage that it cannot reach PostgreSQL."""

    def __init__(
        self,
        settings: Settings,
        *,
        lock_name: str,
        key: int,
        lease: float,
        on_change: Callable[[bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.claim = Claim(lock_name=lock_name, key=key, slot=None, task_id=None, task_name=None)
        self.lease_seconds = lease
        self.on_change = on_change
        self._lease: Lease | None = None
        self._closed = threading.Event()
        self._outage = False
        self._thread = threading.Thread(target=self._run, name="pglock-beat-election", daemon=True)
        self._prepare()

    def _prepare(self) -> None:  # noqa: B027 - a hook, optional: the rows' way adds nothing
        """What a way of electing adds to the state above."""

    def start(self) -> None:
        self._thread.start()

    @abstractmethod
    def _run(self) -> None:
        """Compete until closed (the thread's body)."""

    @abstractmethod
    def step_down(self, cause: str) -> None:
        """Stop leading, saying why, and stand by."""

    def is_leader(self) -> bool:
        lease = self._lease
        if lease is None:
            return False
        if lease.known_lost:  # verify() asks the server when a pause makes it doubtful
            self.step_down(lease.lost_cause or "lease lost")
            return False
        return True

    def verify(self) -> bool:
        """Ask the server now whether we still lead (after a pause we cannot account for):
        a ping of the leader's session, or a renewal of its row."""
        lease = self._lease
        if lease is not None:
            lease.ask_server()  # after any heartbeat ping in flight: busy is not "leading"
        return self.is_leader()

    def _elected(self, how: str = "") -> None:
        logger.info(
            "beat replica %s is now the leader%s",
            replica_name(),
            how,
            extra={"action": "pglock_beat_leader_elected", "host": HOSTNAME, "pid": os.getpid()},
        )
        self._outage = False
        self._changed(True)

    def _stepped_down(self, cause: str) -> None:
        logger.warning(
            "beat replica %s stepped down as leader: %s",
            replica_name(),
            cause,
            extra={"action": "pglock_beat_leader_lost", "host": HOSTNAME, "pid": os.getpid()},
        )
        self._changed(False)

    def _changed(self, leader: bool) -> None:
        signals.beat_leader_changed.send(sender=self, leader=leader, previous=not leader)
        if self.on_change is not None:
            self.on_change(leader)

    def _report_outage(self, exc: BaseException) -> None:
        if self._closed.is_set() or self._outage:
            return  # one line per outage, not one per retry
        self._outage = True
        logger.error(
            "beat leader election cannot reach PostgreSQL, retrying every %.0f s: %s",
            RETRY_DELAY,
            exc,
            extra={"action": "pglock_beat_db_unavailable"},
        )


class LeaderElection(Competitor):
    """Compete for leadership in a background thread; ``is_leader()`` is a cheap check."""

    def _prepare(self) -> None:
        self.tables = self.settings.tables
        self._session: LeaderSession | None = None  # the lease's, while leading
        self._waiting: LeaderSession | None = None
        self._standby = threading.Event()
        self._standby.set()

    @property
    def connection(self) -> Connection | None:
        """The leader's connection (the driver's), while leading."""
        lease = self._lease
        return lease.lock_connection if lease is not None else None

    def statements(self) -> Statements | None:
        """Statements on the leader's session, for claims that must only succeed while
        leading; None when this replica does not lead."""
        session = self._session
        return session.statements() if session is not None else None

    def connection_failed(self, exc: PgLockError) -> None:
        """The leader's session failed under a claim: the lock went with it."""
        self.step_down(f"leader connection failed: {exc}")

    def step_down(self, cause: str) -> None:
        """Stop leading: close the connection (the server frees the lock) and stand by."""
        lease, self._lease, self._session = self._lease, None, None
        if lease is None:
            return
        unwatch(lease)
        lease.lock_session.close()
        self._stepped_down(cause)
        self._standby.set()

    def close(self) -> None:
        """Resign (the lock is freed at once) and stop competing."""
        self._closed.set()
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.cancel()
        lease, self._lease, self._session = self._lease, None, None
        if lease is not None:
            unwatch(lease)
            lease.lock_session.close()
        self._standby.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._standby.wait()
            if self._closed.is_set():
                return
            try:
                self._compete()
            except (PgLockError, OSError) as exc:
                self._report_outage(exc)
                self._closed.wait(RETRY_DELAY)

    def _compete(self) -> None:
        session = LeaderSession.open(self.settings, self.lease_seconds)
        self._waiting = session
        try:
            session.row("leader_wait", {"key": self.claim.key})
            # Our functions wait out a leader on rows, label the session and arm the
            # lease: the schema must exist.
            session.statements().ensure_schema(auto_migrate=self.settings.auto_migrate)
            self._wait_out_row_leader(session)
            if self._closed.is_set():
                session.close()
                return
            self._promote(session)
        except BaseException:
            session.close()  # closing the session frees the leader lock we may hold
            raise
        finally:
            self._waiting = None

    def _wait_out_row_leader(self, session: LeaderSession) -> None:
        """A replica elected on rows (behind a transaction pooler) holds no session lock,
        so the lock queue let us through: lead only once its row expired. Our lock keeps
        it from renewing, so that is within its lease (``pglock_beat_lease``)."""
        params = {"key": self.claim.key}
        while not self._closed.is_set() and _held_on_rows(session.row("row_held", params)):
            self._closed.wait(ROW_LEADER_POLL)

    def _promote(self, session: LeaderSession) -> None:
        lease: float | None = None
        if session.lease_supported:
            lease = self.lease_seconds
        else:
            logger.warning(
                "PostgreSQL < 14: a frozen beat leader keeps leadership until it dies",
                extra={"action": "pglock_lease_unavailable"},
            )
        params = {"name": application_name(" beat leader"), "lease_ms": lease_ms(lease)}
        session.row("leader_arm", params)
        record = {"key": self.claim.key, "lock_name": self.claim.lock_name}
        session.row("leader_record", {**record, "host": HOSTNAME, "pid": os.getpid()})
        granted = Lease(self.claim, "session", session, token=0, attempts=None, lease_seconds=lease)
        self._standby.clear()
        self._session, self._lease = session, granted
        if lease is not None:
            watch(granted)
        self._elected()


def _held_on_rows(row: Row | None) -> bool:
    return row is not None and bool(row["held"])


def replica_name() -> str:
    """How log lines name this beat replica: two replicas on one host differ by pid."""
    return f"{HOSTNAME} (pid {os.getpid()})"
