"""Claims confirmed as their messages go out, in small batches, not after the whole tick.

A tick of 10,000 due entries publishes for seconds. Confirming each batch as it fills
(``CONFIRM_BATCH`` messages, or ``CONFIRM_EVERY`` seconds after the first one waiting)
keeps what a stopped or killed leader leaves unconfirmed small: a new leader re-sends
every unconfirmed claim at once (``BeatClaims.unconfirmed(at_once=True)``), and each of
them the workers had already received is a double the ledger skips.

Where the transport can (kombu's ``Producer.batch``: Redis, kombu 5.7 and later), the
messages of a batch go to the broker together, in one round trip, just before their
claims are confirmed (``batched``): a claim is confirmed only once its message is on the
broker, and what a failed or interrupted batch leaves unsent is never confirmed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

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
        self._on_broker = len(self._pending)  # of those, known to be on the broker (or unsent)
        self._oldest = time.monotonic()
        self.confirmed = 0
        self.before_confirm: Callable[[], None] = _nothing  # puts the batch on the broker

    def sent(self, item: Due) -> None:
        """``item``'s message went out: confirm it with its batch."""
        if not self._pending:
            self._oldest = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= CONFIRM_BATCH or time.monotonic() - self._oldest >= CONFIRM_EVERY:
            self.flush()

    def flush(self) -> None:
        """Confirm every message sent so far (one round trip)."""
        if not self._pending:
            return
        self.before_confirm()
        pending, self._pending, self._on_broker = self._pending, [], 0
        self._claims.confirm(pending)
        self.confirmed += len(pending)

    def forget_unsent(self) -> int:
        """The batch failed or was cut short: its messages may not be on the broker, so
        their claims stay unconfirmed (re-sent later; a worker skips the ones that did
        arrive). How many."""
        unsent = len(self._pending) - self._on_broker
        del self._pending[self._on_broker :]
        return unsent

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


def _nothing() -> None:
    pass


class _Batch:
    """kombu's batch of one tick: flushed before each confirmation, never confirmed
    unless flushed."""

    def __init__(self, current: Any, confirmations: Confirmations) -> None:
        self._current = current
        self._confirmations = confirmations

    def flush(self) -> None:
        try:
            self._current.flush()
        except Exception as exc:  # noqa: BLE001 - a broker error must not stop beat
            unsent = self._confirmations.forget_unsent()
            if not unsent:  # kombu refuses a failed batch again: said once already
                return
            logger.error(
                "could not send %d message(s) of this tick: %s; they are sent again later",
                unsent,
                exc,
                extra={"action": "pglock_beat_send_failed"},
            )
        except BaseException:  # a stop while sending: delivery uncertain
            self._confirmations.forget_unsent()
            raise


@contextlib.contextmanager
def batched(producer: Any, confirmations: Confirmations) -> Iterator[None]:
    """Messages published inside go to the broker in batches, each just before its
    claims are confirmed (see the module's docstring); without batches (RabbitMQ, an
    older kombu) each message goes out as it is published."""
    open_batch = getattr(producer, "batch", None)
    if open_batch is None:
        yield
        return
    context = open_batch(max_size=4 * CONFIRM_BATCH)  # kombu counts commands, not messages
    batch = _Batch(context.__enter__(), confirmations)
    confirmations.before_confirm = batch.flush
    try:
        yield
    finally:
        confirmations.before_confirm = _nothing
        try:
            batch.flush()  # also on a stop or an error: what was published goes out
        finally:
            with contextlib.suppress(Exception):  # a failed batch refuses a second flush
                context.__exit__(None, None, None)
