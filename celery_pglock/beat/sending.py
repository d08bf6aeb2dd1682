"""Claims confirmed as their messages go out, in small batches, not after the whole tick.

A tick of 10,000 due entries publishes for seconds. Confirming each batch as it fills
(``CONFIRM_BATCH`` messages, or ``CONFIRM_EVERY`` seconds after the first one waiting)
keeps what a stopped or killed leader leaves unconfirmed small: a new leader re-sends
every unconfirmed claim at once (``BeatClaims.unconfirmed(at_once=True)``), and each of
them the workers had already received is a double the ledger skips.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable

from celery_pglock.beat.claims import BeatClaims
from celery_pglock.beat.planner import Due
from celery_pglock.errors import PgLockError

logger = logging.getLogger("celery_pglock.beat")

CONFIRM_BATCH = 250  # messages confirmed in one round trip
CONFIRM_EVERY = 0.25  # seconds a sent message waits for its confirmation at most (while sending)


class Confirmations:
    """The messages of one tick sent but not yet confirmed.

    A full batch is confirmed by a thread while the next one goes out (one batch in flight
    at a time): the round trips stay off the sending path. A failure there is raised in
    the tick by the next call, as if the tick had confirmed the batch itself.
    """

    def __init__(self, claims: BeatClaims, first: Iterable[Due] = ()) -> None:
        self._claims = claims
        self._pending: list[Due] = list(first)  # e.g. paused claims: recorded, never sent
        self._oldest = time.monotonic()
        self._inflight: threading.Thread | None = None
        self._inflight_size = 0
        self._failed: Exception | None = None
        self.confirmed = 0

    def sent(self, item: Due) -> None:
        """``item``'s message went out: confirm it with its batch."""
        if not self._pending:
            self._oldest = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= CONFIRM_BATCH or time.monotonic() - self._oldest >= CONFIRM_EVERY:
            self._wait()
            batch, self._pending = self._pending, []
            self._inflight_size = len(batch)
            self._inflight = threading.Thread(
                target=self._confirm, args=(batch,), name="pglock-beat-confirm", daemon=True
            )
            self._inflight.start()

    def flush(self) -> None:
        """Confirm every message sent so far (the batch in flight, then the rest)."""
        self._wait()
        pending, self._pending = self._pending, []
        if pending:
            self._claims.confirm(pending)
            self.confirmed += len(pending)

    def flush_on_stop(self, cause: BaseException) -> None:
        """Beat stops mid-tick (SIGTERM, an error): confirm what went out, so that the
        next leader re-sends only the rest; if that fails, it re-sends these too."""
        left, error = 0, None
        try:
            self._wait()
        except Exception as exc:  # noqa: BLE001 - the batch in flight failed: said below
            left, error = self._inflight_size, exc
        pending = len(self._pending)
        try:
            self.flush()
        except PgLockError as exc:
            left, error = left + pending, exc
        if left:
            logger.warning(
                "beat stopped mid-tick (%s); %d sent message(s) left unconfirmed: %s",
                type(cause).__name__,
                left,
                error,
                extra={"action": "pglock_beat_unconfirmed"},
            )

    def _confirm(self, batch: list[Due]) -> None:
        try:
            self._claims.confirm(batch)
        except Exception as exc:  # noqa: BLE001 - raised in the tick by the next call
            self._failed = exc
        else:
            self.confirmed += len(batch)

    def _wait(self) -> None:
        """Wait for the batch in flight; raise what it met."""
        if self._inflight is not None:
            self._inflight.join()
            self._inflight = None
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
