"""Beat leader election on rows (the rows lock backend), for where no session is ours.

Behind a transaction pooler a standby cannot wait in the server's lock queue: a session
lock would stay on a server connection other clients then use. Here the leader holds the
leader lock as a row of ``row_locks`` with the server's ``now() + pglock_beat_lease``; the
heartbeat renews it every third of the lease. A standby tries to take the row every
``poll_interval`` and succeeds once it expired: a SIGKILLed leader is replaced within the
lease and one poll. The row's token is the leader's term, and every claim the leader makes
is fenced by it (``leads`` in ``beat_claim`` and ``beat_unsent``): a leader whose row
expired (frozen, partitioned) claims nothing, so sends nothing, even before it learns of
its loss at its next renewal.

The same face as ``LeaderElection`` (``_leader``), which the scheduler picks for the
advisory backend.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from celery_pglock._heartbeat import unwatch, watch
from celery_pglock._protocol import Lease
from celery_pglock._row_hold import RowHold
from celery_pglock.beat._leader import RETRY_DELAY, Competitor
from celery_pglock.errors import DatabaseError, PgLockError
from celery_pglock.store._database import Database, database
from celery_pglock.store.statements import Params, Row

logger = logging.getLogger("celery_pglock.beat")

MAX_POLL_INTERVAL = 0.5  # seconds between a standby's tries (a fifth of a shorter lease)


class RowElection(Competitor):
    """Compete for leadership on rows in a background thread; ``is_leader()`` is cheap."""

    @property
    def poll_interval(self) -> float:
        """Seconds between a standby's tries: a fifth of the lease, at most half a second."""
        return min(MAX_POLL_INTERVAL, self.lease_seconds / 5)

    @property
    def connection(self) -> None:
        """No connection is the leader's own on rows."""
        return None

    def statements(self) -> FencedStatements | None:
        """Statements for claims that must only succeed while leading, fenced by this
        leader's term; None when this replica does not lead."""
        lease = self._lease
        if lease is None:
            return None
        return FencedStatements(database(self.settings), self.claim.key, lease.token)

    def connection_failed(self, exc: DatabaseError) -> None:
        """A claim's pooled connection failed: the row, not a session, is the leadership;
        it lasts until the heartbeat fails to renew it."""

    def step_down(self, cause: str) -> None:
        """Stop leading (the row is given up if still ours) and stand by."""
        if self._resign():
            self._stepped_down(cause)

    def close(self) -> None:
        """Resign (a standby takes over at its next try) and stop competing."""
        self._closed.set()
        self._resign()

    def _resign(self) -> bool:
        lease, self._lease = self._lease, None
        if lease is None:
            return False
        unwatch(lease)
        params = {**self.claim.params(), "token": lease.token, "state": None, "reason": None}
        try:
            lease.lock_session.row("release_rows", params)
        except DatabaseError as exc:  # it expires by itself
            logger.debug("leader row not given up: %s", exc, extra={"action": "pglock_beat"})
        return True

    def _run(self) -> None:
        while not self._closed.is_set():
            if self._lease is None:
                try:
                    self._try_to_lead(database(self.settings))
                except (PgLockError, OSError) as exc:
                    self._report_outage(exc)
                    self._closed.wait(RETRY_DELAY)
                    continue
            self._closed.wait(self.poll_interval)

    def _try_to_lead(self, db: Database) -> None:
        params = {**self.claim.params(), "lease_s": self.lease_seconds}
        sent = time.monotonic()
        with db.statements() as statements:
            row = statements.row("acquire_rows", params)
        self._outage = False
        if row is None or not row["acquired"]:
            return
        token = int(row["token"])
        hold = RowHold(db.lock_sessions, self.claim.key, token, self.lease_seconds, sent)
        self._lease = Lease(self.claim, "session", hold, token, None, self.lease_seconds)
        if self._closed.is_set():  # closed meanwhile: the row given back, not left to expire
            self._resign()
            return
        watch(self._lease)
        self._elected(f" (on rows, term {token})")


class FencedStatements:
    """A leader's statements on rows: each on a pooled connection, with the leader's lock
    key and term, which ``beat_claim`` and ``beat_unsent`` check (``leads``)."""

    def __init__(self, db: Database, key: int, term: int) -> None:
        self._db = db
        self._fence: dict[str, Any] = {"leader_key": key, "term": term}

    def rows(self, name: str, params: Params | None = None) -> list[Row]:
        with self._db.statements() as statements:
            return statements.rows(name, {**(params or {}), **self._fence})
