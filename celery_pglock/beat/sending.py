"""Claims confirmed as their messages go out, in small batches, not after the whole tick.

A tick of 10,000 due entries publishes for seconds. Confirming each batch as it fills
(``CONFIRM_BATCH`` messages, or ``CONFIRM_EVERY`` seconds after the first one waiting)
keeps what a stopped or killed leader leaves unconfirmed small: a new leader re-sends
every unconfirmed claim at once (``BeatClaims.unconfirmed(at_once=True)``), and each of
them the workers had already received is a double the ledger skips.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from celery_pglock.beat.claims import BeatClaims
from celery_pglock.beat.planner import Due
from celery_pglock.errors import PgLockError

logger = logging.getLogger("celery_pglock.beat")

CONFIRM_BATCH = 250  # messages confirmed in one round trip
CONFIRM_EVERY = 0.25  # seconds a sent message waits for its confirmation at most (while sending)


class Confirmations:
    """The messages of one tick sent but not yet confirmed."""

    def __init__(self, claims: BeatClaims, first: Iterable[Due] = ()) -> None:
        self._claims = claims
        self._pending: list[Due] = list(first)  # e.g. paused claims: recorded, never sent
        self._oldest = time.monotonic()
        self.confirmed = 0

    def sent(self, item: Due) -> None:
        """``item``'s message went out: confirm it with its batch."""
        if not self._pending:
            self._oldest = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= CONFIRM_BATCH or time.monotonic() - self._oldest >= CONFIRM_EVERY:
            self.flush()

    def flush(self) -> None:
        """Confirm every message sent so far (one round trip)."""
        pending, self._pending = self._pending, []
        if pending:
            self._claims.confirm(pending)
            self.confirmed += len(pending)

    def flush_on_stop(self, cause: BaseException) -> None:
        """Beat stops mid-tick (SIGTERM, an error): confirm what went out, so that the
        next leader re-sends only the rest; if that fails, it re-sends these too."""
        pending = len(self._pending)
        try:
            self.flush()
        except PgLockError as exc:
            logger.warning(
                "beat stopped mid-tick (%s); %d sent message(s) left unconfirmed: %s",
                type(cause).__name__,
                pending,
                exc,
                extra={"action": "pglock_beat_unconfirmed"},
            )
