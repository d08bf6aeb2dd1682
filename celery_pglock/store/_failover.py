"""What a process notices when its PostgreSQL was failed over: a newer timeline.

Every promotion starts a new timeline. With asynchronous replication the promoted replica
can lack the old primary's last commits, among them successes this process recorded and
saw acknowledged: their slots could then run again. So each process remembers the
successes it recorded lately (``RECALL_SECONDS``), and the first connection it opens on a
newer timeline checks them on the new primary. A success that was lost is written back
(the run did happen; the slot must not run again). One whose slot was claimed again
meanwhile ran twice: logged as an ERROR, the one thing that can no longer be prevented.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from celery_pglock.schema import Tables
from celery_pglock.store._driver import Connection

logger = logging.getLogger("celery_pglock")


RECALL_SECONDS = 300.0  # far beyond any replication lag a failover manager accepts
RECALL_LIMIT = 1000  # successes per process; the oldest are forgotten first
# The timeline of the WAL being written (NULL on a standby): its file name's first 8 hex
# digits. pg_control_checkpoint() would tell only after the next checkpoint.
TIMELINE_SQL = (
    "SELECT CASE WHEN NOT pg_is_in_recovery() THEN"
    " ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int END"
)


class Claim(Protocol):
    """What is recalled of an attempt's claim (``protocol.Claim``, which stands on ``db``:
    named here by shape, so that ``db`` can hold a ``Recall`` without a circle)."""

    @property
    def lock_name(self) -> str: ...

    @property
    def slot(self) -> str | None: ...

    def params(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Success:
    """A success this process recorded, on the timeline it knew then."""

    claim: Claim
    token: int
    timeline: int
    at: float  # time.monotonic()


class Recall:
    """The timeline a process last saw and the successes it recorded lately."""

    def __init__(self) -> None:
        self.timeline = 0  # 0: no connection yet
        self._successes: deque[Success] = deque(maxlen=RECALL_LIMIT)
        self._lock = threading.Lock()

    def remember(self, claim: Claim, token: int) -> None:
        if claim.slot is not None:
            self._successes.append(Success(claim, token, self.timeline, time.monotonic()))

    def connected(self, conn: Connection, tables: Tables) -> None:
        """A new connection: if its server is on a newer timeline, check what we recall."""
        row = conn.execute(TIMELINE_SQL).fetchone()
        timeline = row[0] if row else None
        if timeline is None or timeline <= self.timeline:
            return
        with self._lock:
            if timeline <= self.timeline:
                return
            first, self.timeline = self.timeline == 0, timeline
            horizon = time.monotonic() - RECALL_SECONDS
            due = [s for s in self._successes if s.timeline < timeline and s.at > horizon]
        if not first:
            for success in due:
                verify(conn, tables, success, timeline)


def verify(conn: Connection, tables: Tables, success: Success, timeline: int) -> None:
    """Write ``success`` back if the failover lost it; log it if its slot ran again."""
    params = {**success.claim.params(), "token": success.token}
    row = conn.execute(tables.query("restore_success"), params).fetchone()
    restored, state, token = row if row else (0, None, None)
    claim = success.claim
    if restored:
        logger.warning(
            "the failover to timeline %d lost the success of %r for slot %r (token %d): "
            "written back from this process's memory, so the slot does not run again",
            timeline,
            claim.lock_name,
            claim.slot,
            success.token,
            extra={"action": "pglock_failover_success_restored", "lock": claim.lock_name},
        )
    elif token != success.token:
        logger.error(
            "slot %r of %r ran again after the failover to timeline %d lost its success "
            "(token %d on the old primary; now %s with token %s): asynchronous replication "
            "loses the last commits at a failover, synchronous replication does not",
            claim.slot,
            claim.lock_name,
            timeline,
            success.token,
            state,
            token,
            extra={"action": "pglock_failover_ran_again", "lock": claim.lock_name},
        )
