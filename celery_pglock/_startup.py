"""Waiting for PostgreSQL at start-up, as Celery waits for its broker.

A worker, a beat replica or a long-running ``celery pglock`` command that starts while
PostgreSQL is briefly away (a failover, a rolling deploy, a node reboot) waits for it: an
orchestrator that restarts an exited process backs off exponentially, and would bring it
back minutes after the database. Attempts come 1, 2, 4 … 30 s apart; each failed one logs
one WARNING (the reason, the next delay) and the first that succeeds after a failure one
INFO line. In between, each server the DSN names is pinged once a second (libpq's
``PQping``: no session, no authentication, 2 s at most), so that the next attempt comes
as soon as a server that did not answer does again (a restart, a reboot) rather than at
the end of a long delay. A server that answered all along but refused (a standby not
promoted yet, no connection slot) gives no such sign: the delay is waited out. A
misconfiguration (any ``ConfigurationError``, such as ``DatabaseMisconfigured``) is never
waited for. ``pglock_connection_retry_on_startup = False`` gives up at the first failure
and ``pglock_connection_max_retries = N`` after N more, as Celery's
``broker_connection_retry_on_startup`` and ``broker_connection_max_retries`` do.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NoReturn, TypeVar

from celery_pglock._config import Settings
from celery_pglock.errors import ConfigurationError, DatabaseUnavailable
from celery_pglock.store._ping import answering

T = TypeVar("T")

FIRST_DELAY = 1.0  # seconds after the first failed attempt; doubled after each one
MAX_DELAY = 30.0
PING_EVERY = 1.0  # seconds between two rounds of pings while waiting
NAP = 0.1  # seconds between two looks at a stop request while waiting


def delay_after(failures: int) -> float:
    """Seconds to wait after the ``failures``-th failed attempt: 1, 2, 4 … 30."""
    return min(MAX_DELAY, FIRST_DELAY * 2.0 ** min(failures - 1, 16))


class StartupWait:
    """One process's attempts to reach PostgreSQL as it starts; never blocks by itself.

    ``due()`` says when to attempt, ``failed(exc)`` and ``succeeded()`` report how an
    attempt went. ``who`` names the process in the log lines (``worker``, ``beat``, …).
    """

    def __init__(
        self,
        settings: Settings,
        who: str,
        logger: logging.Logger,
        *,
        clock: Callable[[], float] = time.monotonic,
        ping: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        self.settings = settings
        self.who = who
        self.logger = logger
        self.clock = clock
        self.ping = ping if ping is not None else lambda: answering(settings)
        self.failures = 0
        self.began = clock()
        self.next_attempt = self.began
        self._next_ping = self.began
        self._answered: frozenset[str] = frozenset()  # the servers the last pings reached

    def due(self) -> bool:
        """Whether to attempt now: the delay is over, or a server has just come back (it
        answers a ping where the last round found it silent)."""
        now = self.clock()
        if now >= self.next_attempt:
            return True
        if now < self._next_ping:
            return False
        answered, self._answered = self._answered, self.ping()
        self._next_ping = self.clock() + PING_EVERY
        return bool(self._answered - answered)

    def failed(self, exc: DatabaseUnavailable) -> None:
        """Note a failed attempt and say so; raise when waiting is not the answer (a
        misconfiguration, pglock_connection_retry_on_startup off, the retries spent)."""
        if isinstance(exc, ConfigurationError):
            raise exc
        self.failures += 1
        self._give_up_unless_allowed(exc)
        delay = delay_after(self.failures)
        self.next_attempt = self.clock() + delay
        self._answered = self.ping()  # a server that answers but refuses: no early wake
        self._next_ping = self.clock() + PING_EVERY
        self.logger.warning(
            "celery-pglock (%s) is waiting for PostgreSQL: attempt %d failed, next in %s s "
            "(sooner if the server answers again): %s",
            self.who,
            self.failures,
            f"{delay:g}",
            exc,
            extra={"action": "pglock_startup_waiting", "attempt": self.failures, "delay": delay},
        )

    def succeeded(self) -> None:
        """Say once that PostgreSQL answers, if the process had to wait for it."""
        if self.failures:
            self.logger.info(
                "celery-pglock (%s): PostgreSQL answers, after %d failed attempts in %.1f s",
                self.who,
                self.failures,
                self.clock() - self.began,
                extra={"action": "pglock_startup_db_ready", "attempts": self.failures},
            )

    def _give_up_unless_allowed(self, exc: DatabaseUnavailable) -> None:
        if not self.settings.retry_on_startup:
            raise DatabaseUnavailable(f"{exc} (not waiting: pglock_connection_retry_on_startup)")
        limit = self.settings.max_retries
        if limit is not None and self.failures > limit:
            raise DatabaseUnavailable(
                f"gave up after {self.failures} attempts in {self.clock() - self.began:.0f} s "
                f"(pglock_connection_max_retries = {limit}): {exc}"
            )


def wait_for_postgres(
    settings: Settings,
    attempt: Callable[[], T],
    *,
    who: str,
    logger: logging.Logger,
    interrupt: Callable[[], None] = lambda: None,
) -> T:
    """What ``attempt()`` returns once it succeeds, waiting as ``StartupWait`` says
    meanwhile; ``interrupt`` is called while waiting and raises to end the wait (a
    worker's shutdown request)."""
    wait = StartupWait(settings, who, logger)
    while True:
        try:
            found = attempt()
        except DatabaseUnavailable as exc:
            wait.failed(exc)
            while not wait.due():
                interrupt()
                time.sleep(NAP)
            continue
        wait.succeeded()
        return found


def refuse_to_start(who: str, logger: logging.Logger, exc: BaseException) -> NoReturn:
    """Stop a process at start-up with one line saying why (no traceback), status 1."""
    logger.critical(
        "celery-pglock (%s) cannot start: %s",
        who,
        exc,
        extra={"action": "pglock_startup_failed", "error": type(exc).__name__},
    )
    raise SystemExit(1)
