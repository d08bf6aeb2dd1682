"""Freshness: know when a periodic job did not run (``pglock_overdue_after``).

The beat leader looks at the ledger on every tick (about every second): for each entry
with a deadline, its newest succeeded slot and the oldest slot sent since then that has
not succeeded. That slot is *overdue* once it fell due more than the deadline ago (its
*deadline*: due time + ``pglock_overdue_after``; ``overdue_seconds``: how long past it):
the leader fires ``task_overdue``, logs one WARNING (``action`` ``pglock_entry_overdue``),
once per slot, and publishes ``entry_freshness`` for the metrics for each entry it reads.
A look also learns the next deadline of a slot still pending, and beat wakes for it
(``wake_in``), so an alert comes at its deadline, not up to a tick later. No extra process.

A look reads the entries in play (sent by this leader since the last look, or pending at
it) and ``SLICE`` more, in turn: a schedule of up to ``SLICE`` entries is read whole at
every look, a larger one in rounds of a second per ``SLICE`` (read whole, 100,000
entries with a deadline took 2 s a look, every second; without one, 0.1 s).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_pglock import _slots as slots
from celery_pglock import signals
from celery_pglock._ledger import RunQuery
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.store.statements import Statements

logger = logging.getLogger("celery_pglock.beat")

CHECK_EVERY = 1.0  # seconds between two regular looks
SLICE = 1000  # entries a look reads besides those in play
# Beat wakes on the second give or take a few ms: a tick this much early still looks
# (else every other tick would skip its look).
EARLY = 0.1
PAST_DEADLINE = 0.05  # seconds after a deadline its look comes, whatever the clocks' jitter


@dataclass(frozen=True)
class Freshness:
    """One entry as the ledger shows it now."""

    entry: str
    overdue_after: float
    last_success: str | None  # slot
    last_success_at: datetime | None
    first_pending: str | None  # the oldest slot sent since then that did not succeed
    last_due: str | None  # the newest slot sent
    now: datetime

    @property
    def pending_for(self) -> float | None:
        """Seconds since the oldest slot that has not succeeded fell due."""
        if self.first_pending is None:
            return None
        return (self.now - slots.parse_slot(self.first_pending)).total_seconds()

    @property
    def overdue_by(self) -> float | None:
        """Seconds past the deadline (``overdue_seconds``), when overdue; None when not."""
        waited = self.pending_for
        if waited is None or waited <= self.overdue_after:
            return None
        return waited - self.overdue_after

    @property
    def deadline_in(self) -> float | None:
        """Seconds until the pending slot's deadline, when it has one still to come."""
        waited = self.pending_for
        if waited is None or waited > self.overdue_after:
            return None
        return self.overdue_after - waited


def evaluate(
    rows: Iterable[dict[str, Any]], deadlines: dict[str, float], now: datetime
) -> list[Freshness]:
    """``beat_freshness`` rows as ``Freshness``, overdue entries first."""
    found = [
        Freshness(
            row["entry"],
            deadlines[row["entry"]],
            row["last_success"],
            row["last_success_at"],
            row["first_pending"],
            row["last_due"],
            now,
        )
        for row in rows
        if row["entry"] in deadlines
    ]
    return sorted(found, key=lambda f: (f.overdue_by is None, -(f.overdue_by or 0), f.entry))


def freshness_params(
    settings: BeatSettings, deadlines: dict[str, float], lock_names: dict[str, str]
) -> dict[str, Any]:
    """The parameters of ``beat_freshness`` for these entries."""
    names = sorted(deadlines)
    return {
        "namespace": settings.namespace,
        "entries": names,
        "lock_names": [lock_names[name] for name in names],
        "slot_pattern": slots.SLOT_PATTERN,
    }


class FreshnessWatch:
    """The beat leader's look at the ledger: on each tick at most every ``CHECK_EVERY``
    seconds, and at each pending slot's deadline (``wake_in``)."""

    def __init__(
        self,
        settings: BeatSettings,
        run_query: RunQuery,
        sender: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self._run_query = run_query
        self._sender = sender
        self._clock = clock
        self._next = 0.0  # the next regular look (monotonic)
        self._deadline = math.inf  # the next pending slot's deadline (monotonic)
        # Entry -> its slot reported overdue (its oldest pending slot only moves forward, so
        # one an entry is enough: a set of every slot ever reported grew for good).
        self._told: dict[str, str] = {}
        self._in_play: set[str] = set()  # sent since the last look, or pending at it
        self._round: list[str] = []  # the names read SLICE at a time, in turn
        self._turn = 0  # where the next slice of the round starts

    def sent(self, names: Iterable[str]) -> None:
        """These entries' slots just went out: the next look reads them."""
        self._in_play.update(names)

    def maybe_check(
        self, entries: Mapping[str, Any], lock_name: Callable[[Any], str], now: datetime
    ) -> None:
        clock = self._clock()
        if clock < min(self._next, self._deadline):
            return
        self._next = clock + CHECK_EVERY - EARLY
        names = self._in_play.union(self._next_slice(entries))
        looked = [entries[name] for name in names if name in entries]
        found = look(self.settings, looked, lock_name, self._run_query, now)
        self._in_play = {f.entry for f in found if f.first_pending is not None}
        coming = [f.deadline_in for f in found if f.deadline_in is not None]
        self._deadline = clock + min(coming) + PAST_DEADLINE if coming else math.inf
        for fresh in found:
            self._publish(fresh)

    def _next_slice(self, entries: Mapping[str, Any]) -> list[str]:
        """The next ``SLICE`` names of the round; a new round takes the names as they are."""
        if self._turn >= len(self._round):
            self._round, self._turn = list(entries), 0
        start, self._turn = self._turn, self._turn + SLICE
        return self._round[start : self._turn]

    def wake_in(self) -> float:
        """Seconds until the next deadline of a pending slot (beat sleeps no longer)."""
        return max(0.0, self._deadline - self._clock())

    def _publish(self, fresh: Freshness) -> None:
        overdue = fresh.overdue_by is not None
        signals.entry_freshness.send(
            sender=self._sender,
            entry=fresh.entry,
            last_success_at=fresh.last_success_at,
            overdue=overdue,
        )
        if fresh.first_pending is None:
            self._told.pop(fresh.entry, None)  # it succeeded since
        if not overdue or fresh.first_pending is None:
            return
        if self._told.get(fresh.entry) == fresh.first_pending:
            return
        self._told[fresh.entry] = fresh.first_pending
        self._report(fresh)

    def _report(self, fresh: Freshness) -> None:
        logger.warning(
            "beat entry %r is overdue: slot %s fell due %s s ago and has not succeeded, "
            "%s s past its deadline (pglock_overdue_after %s s; last success: %s)",
            fresh.entry,
            fresh.first_pending,
            seconds(fresh.pending_for or 0.0),
            seconds(fresh.overdue_by or 0.0),
            seconds(fresh.overdue_after),
            fresh.last_success or "none",
            extra={
                "action": "pglock_entry_overdue",
                "entry": fresh.entry,
                "slot": fresh.first_pending,
                "overdue_seconds": round(fresh.overdue_by or 0.0, 1),
            },
        )
        signals.task_overdue.send(
            sender=self._sender,
            entry=fresh.entry,
            slot=fresh.first_pending,
            overdue_seconds=fresh.overdue_by,
            last_success=fresh.last_success,
            last_success_at=fresh.last_success_at,
        )


def seconds(value: float) -> str:
    """A number of seconds as people read it: 2.5, 4, 600 (one decimal at most)."""
    return f"{value:.1f}".removesuffix(".0")


def look(
    settings: BeatSettings,
    entries: Iterable[Any],
    lock_name: Callable[[Any], str],
    run_query: RunQuery,
    now: datetime,
) -> list[Freshness]:
    """Every entry with a deadline, as the ledger shows it at ``now``, overdue first."""
    watched = list(entries)
    deadlines = {e.name: d for e in watched if (d := settings.entry_overdue_after(e))}
    if not deadlines:
        return []
    names = {e.name: lock_name(e) for e in watched if e.name in deadlines}
    rows = run_query("beat_freshness", freshness_params(settings, deadlines, names))
    return evaluate(rows, deadlines, now)


def entries_freshness(
    statements: Statements,
    settings: BeatSettings,
    entries: Iterable[Any],
    lock_name: Callable[[Any], str],
) -> list[Freshness]:
    """``look`` through ``statements``, now (``celery pglock status``)."""
    return look(settings, entries, lock_name, statements.rows, datetime.now(timezone.utc))
