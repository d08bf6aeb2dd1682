"""Claims confirmed as their messages go out, in small batches, not after the whole tick.

A tick of 10,000 due entries publishes for seconds. Confirming each batch as it fills
(``CONFIRM_BATCH`` messages, or ``CONFIRM_EVERY`` seconds after the first one waiting)
keeps what a stopped or killed leader leaves unconfirmed small: a new leader re-sends
every unconfirmed claim at once (``BeatClaims.unconfirmed(at_once=True)``), and each of
them the workers had already received is a double the ledger skips.

Where the transport can (kombu's ``Producer.batch``: Redis, kombu 5.7 and later), the
messages of a batch go to the broker together, in one round trip, just before their
claims are confirmed (``batched``): a claim is confirmed only once its message is on the
broker, and what a failed batch leaves unsent is never confirmed.

A stop (SIGTERM, Ctrl-C) is held while a message or a batch goes out and is confirmed
(``HeldStops``), so that it finds each batch either on the broker and confirmed, or unsent.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, Protocol

from celery_pglock.beat._planner import Due
from celery_pglock.errors import PgLockError

logger = logging.getLogger("celery_pglock.beat")

CONFIRM_BATCH = 250  # messages confirmed in one round trip
CONFIRM_EVERY = 0.25  # seconds a sent message waits for its confirmation at most (while sending)
STOP_FINISH_WITHIN = 5.0  # seconds a stopped leader goes on sending its tick's claims
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # Celery's beat handler: close, SystemExit

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class HeldStops:
    """SIGTERM and SIGINT held back inside, delivered when it ends (never lost).

    Celery's beat handler raises SystemExit wherever the main thread is. Raised inside
    redis-py's write of a batch (part of it on the broker) or inside the batch's
    confirmation, it left messages on the broker unconfirmed, and the next leader sent
    them again (issue 34: 6 to 157 doubles per stop). Held, the stop waits for the
    message or batch in flight to be on the broker and confirmed; the sender looks at
    ``caught`` between two messages and stops there. A further stop while one waits is
    delivered at once (stuck on the broker or the database, beat can still be stopped),
    and counts as a second stop (``received``).
    Python runs signal handlers in the main thread, whichever thread the signal reached,
    so swapping the handlers there holds the process's stops (``pthread_sigmask`` in one
    thread would not). In another thread (``celery worker -B`` may run beat in one) no
    handler raises into the sends, and nothing is swapped. Nested holds: the outer holds.
    """

    def __init__(self) -> None:
        self.caught: int | None = None  # the stop waiting for the hold to end
        self.received = 0  # stops while held (a second one was delivered at once)
        self._saved: dict[int, _Handler] = {}

    def __enter__(self) -> HeldStops:
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                handler = signal.getsignal(signum)
                if handler in (None, signal.SIG_IGN) or isinstance(handler, HeldStops):
                    continue  # not set from Python (cannot be put back), ignored, or held
                self._saved[signum] = signal.signal(signum, self)
        return self

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1
        if self.received == 1:
            self.caught = signum
            return
        self.caught = None  # delivered with this one: one handler call for both
        self._release()
        signal.raise_signal(signum)  # a further stop: at once, by its own handler

    def __exit__(self, *exc: object) -> None:
        self._release()
        caught, self.caught = self.caught, None
        if caught is not None:
            signal.raise_signal(caught)  # its own handler runs now, in this thread

    def _release(self) -> None:
        saved, self._saved = self._saved, {}
        for signum, handler in saved.items():
            signal.signal(signum, handler)


class Confirms(Protocol):
    """Where sends are confirmed: ``BeatClaims`` (the ledger)."""

    def confirm(self, sent: Iterable[Due]) -> None: ...


class Confirmations:
    """The messages of one tick sent but not yet confirmed."""

    def __init__(self, claims: Confirms, first: Iterable[Due] = ()) -> None:
        self._claims = claims
        self._pending: list[Due] = []
        self._on_broker = 0  # the first of those known to be on the broker (or unsent)
        self._oldest = time.monotonic()
        self.confirmed = 0
        self.before_confirm: Callable[[], None] = _nothing  # puts the batch on the broker
        self.recorded(first)

    def recorded(self, items: Iterable[Due]) -> None:
        """Confirm ``items`` with the next batch, never sent (e.g. paused claims)."""
        items = list(items)
        if items and not self._pending:
            self._oldest = time.monotonic()
        self._pending[:0] = items
        self._on_broker += len(items)

    def sent(self, item: Due) -> None:
        """``item``'s message went out: confirm it with its batch."""
        if not self._pending:
            self._oldest = time.monotonic()
        self._pending.append(item)
        if len(self._pending) >= CONFIRM_BATCH or time.monotonic() - self._oldest >= CONFIRM_EVERY:
            self.flush()

    def flush(self) -> None:
        """Put what was sent so far on the broker and confirm it (one round trip each),
        a stop held till both are done; forgotten only once confirmed."""
        if not self._pending:
            return
        with HeldStops():
            self.before_confirm()
            self._claims.confirm(self._pending)
            self.confirmed += len(self._pending)
            self._pending, self._on_broker = [], 0

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
        except BaseException as exc:  # a further stop while sending: delivery uncertain
            logger.warning(
                "beat stopped while a batch went out (%s); %d sent message(s) left unconfirmed",
                type(exc).__name__,
                self._confirmations.forget_unsent(),
                extra={"action": "pglock_beat_unconfirmed"},
            )
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
