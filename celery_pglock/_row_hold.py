"""A lock held on rows (the rows lock backend), as a run's ``Lease`` sees it.

Behind a transaction pooler no server session is ours: a session advisory lock would stay
behind on a server connection that other clients then use. There a lock is a row of
``row_locks`` stamped with the server's ``now() + lease`` (``acquire_rows``); the
heartbeat renews it every third of the lease (``ping``), each renewal one short
transaction on any pooled connection; another claimer takes the key over only once the
row expired. So a crashed holder frees its lock when its lease runs out, not at once, and
a frozen one learns of its loss at its next renewal.

``RowHold`` stands where an advisory lock's ``LockSession`` stands in a ``Lease``: its
``ping`` renews the row and raises ``SessionGone`` once the lock is lost, so the heartbeat,
``Lease.lost`` and ``Lease.check`` work unchanged; the body borrows a pooled connection of
its own (``driver``), given back at the release.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from celery_pglock._values import Scope
from celery_pglock.errors import DatabaseError, DatabaseUnavailable, SessionGone
from celery_pglock.store._driver import Connection
from celery_pglock.store._lock_sessions import LockSession, LockSessions, Params, Row

logger = logging.getLogger("celery_pglock")

# A lock on rows always expires: with the lease turned off (pglock_lease = 0) a crashed
# holder's lock would stay taken for ever, so it gets this one (seconds).
DEFAULT_ROW_LEASE = 30.0


class RowHold:
    """The ``LockSession`` of a lock held on rows: lock ``key`` under ``token``, valid
    until ``valid_until`` (``time.monotonic``) unless renewed."""

    def __init__(
        self, sessions: LockSessions, key: int, token: int, lease_seconds: float, sent: float
    ) -> None:
        self._sessions = sessions
        self.key = key
        self.token = token
        self.lease_seconds = lease_seconds
        # The server stamped now() + lease after we sent the statement: our own reckoning
        # from the moment we sent it never outlives the row.
        self.valid_until = sent + lease_seconds
        self._lent: LockSession | None = None

    def __repr__(self) -> str:
        return f"<RowHold key={self.key} token={self.token}>"

    @property
    def driver(self) -> Connection:
        """A pooled connection of the body's own, kept until the release."""
        if self._lent is None:
            self._lent = self._sessions.take()
        return self._lent.driver

    @property
    def closed(self) -> bool:
        return False

    def row(self, name: str, params: Params | None = None, *, outage: bool = False) -> Row | None:
        """Statement ``name`` on a pooled session, one transaction."""
        with self._sessions.statements() as statements:
            return statements.row(name, params)

    def ping(self) -> None:
        """Renew the row: ``SessionGone`` once the lock is lost (the row expired or was
        taken over, or it could not be renewed before it expires); a failure that leaves
        time is a plain ``DatabaseUnavailable``, tried again at the next ping."""
        sent = time.monotonic()
        params = {"key": self.key, "token": self.token, "lease_s": self.lease_seconds}
        try:
            renewed = self.row("renew_row_lock", params)
        except DatabaseError as exc:
            if time.monotonic() >= self.valid_until:
                raise SessionGone(f"the lease ran out before it could be renewed: {exc}") from exc
            raise DatabaseUnavailable(f"the lease was not renewed, tried again: {exc}") from exc
        if renewed is None or renewed["expires_at"] is None:
            raise SessionGone(
                "the lease ran out before it was renewed (a freeze, or PostgreSQL unreachable "
                "for the whole lease): another holder may have taken the lock over"
            )
        self.valid_until = sent + self.lease_seconds

    def give_back_lent(self) -> None:
        """Return the body's connection to the pool (at the release)."""
        lent, self._lent = self._lent, None
        if lent is not None:  # a transaction the body left open is rolled back there
            self._sessions.give_back(lent, clean=True)

    # The rest of ``LockSession``: nothing of a session to manage.

    def use_scope(self, scope: Scope) -> None:
        """Every statement of a lock on rows is a transaction of its own."""

    def in_transaction(self) -> bool:
        return False

    def commit(self) -> None:
        """Nothing to commit: each statement committed by itself."""

    def rollback(self) -> None:
        """Nothing to roll back."""

    def send_unwaited(self, name: str, params: Sequence[str | None], timeout: float) -> bool:
        return False

    def busy(self) -> bool:
        return False  # renewals go through the pool, never on the body's connection

    def close(self) -> None:
        self.give_back_lent()
