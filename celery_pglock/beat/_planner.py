"""Which slots of which entries are due now: the part of a tick that needs no database.

The planner remembers, per entry, the last slot sent and when to look again, the next
looks in a heap: a tick looks only at the entries whose time has come, so a tick with
nothing due costs the same with 100,000 entries as with ten. The whole schedule is read
again only when it changed (``rescan``: new names to look at). A replica that takes over
leadership starts from the last slots sent as stored (``take_over``), not from its own
memory: otherwise a slot that fell due while no replica led would be taken as already
seen, and silently never sent.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from celery_pglock import _slots as slots
from celery_pglock.beat._settings import BeatSettings

logger = logging.getLogger("celery_pglock.beat")

# An entry is read again at its next occurrence, and at least this often (seconds): a
# wall clock stepped back delays its looks by no more than the step and this.
LOOK_AT_LEAST_EVERY = 300.0


class Due(NamedTuple):
    entry: Any
    slot: str
    lock_name: str


class SlotPlanner:
    """The due slots of a schedule, tick after tick."""

    def __init__(self, settings: BeatSettings, max_interval: float) -> None:
        self.settings = settings
        self.max_interval = max_interval
        self.last_slot: dict[str, str] = {}  # per entry; "" while no aligned slot is known
        self._stored_slots: dict[str, str] = {}  # last slot sent per entry, read on takeover
        self._wake_at: dict[str, float] = {}  # when to look at each entry next
        self._heap: list[tuple[float, str]] = []  # the same looks, soonest first (and stale)
        self._scanned = False  # every entry of the schedule has a look to come

    def take_over(self, stored_slots: Mapping[str, str]) -> None:
        """Go on from the last slots sent by whichever replica led before."""
        self._stored_slots = dict(stored_slots)
        self.last_slot.clear()
        self._wake_at.clear()
        self._heap.clear()
        self._scanned = False

    def due(
        self,
        entries: Mapping[str, Any],
        now: datetime,
        lock_name: Callable[[Any], str],
        *,
        rescan: bool = True,
    ) -> list[Due]:
        """The slots to send now, with ``pglock_beat_catch_up = "all"``'s missed ones first.
        ``rescan``: the schedule may have names never looked at (else only the entries
        whose look has come are read)."""
        if rescan or not self._scanned:
            for name in entries:
                if name not in self._wake_at:
                    self._look_at(name, 0.0)
            self._scanned = True
        due: list[Due] = []
        clock = now.timestamp()
        for name in self._looks_until(clock):
            entry = entries.get(name)
            if entry is None:
                continue  # removed from the schedule: no look to come
            if not enabled(entry, now):  # switched off, or not in its window now
                self._look_at(name, clock + self.max_interval)
                continue
            slot = self._slot_if_due(entry, now)
            if slot is not None:
                lock = lock_name(entry)
                due.extend(Due(entry, missed, lock) for missed in self._missed_before(entry, slot))
                due.append(Due(entry, slot, lock))
        return due

    def changed(self, name: str) -> None:
        """Entry ``name`` changed: look at it at the next tick (its new schedule may fall
        due sooner), going on from the last slot sent, so that none is sent twice."""
        self._look_at(name, 0.0)

    def _look_at(self, name: str, at: float) -> None:
        self._wake_at[name] = at
        heapq.heappush(self._heap, (at, name))

    def _looks_until(self, clock: float) -> list[str]:
        """The entries whose look has come by ``clock``, taken off the heap (each has a
        new one once looked at)."""
        found: list[str] = []
        while self._heap and self._heap[0][0] <= clock:
            at, name = heapq.heappop(self._heap)
            if self._wake_at.get(name) == at:  # else stale: looked at since, or later
                del self._wake_at[name]
                found.append(name)
        return found

    def sent(self, due: Iterable[Due]) -> None:
        """These slots are dealt with (claimed here or by another replica)."""
        for item in due:
            self.last_slot[item.entry.name] = item.slot

    def next_wake(self) -> float:
        """Seconds until an entry may next be due."""
        heap = self._heap
        while heap and self._wake_at.get(heap[0][1]) != heap[0][0]:
            heapq.heappop(heap)  # stale
        if not heap:
            return self.max_interval
        soonest = heap[0][0] - time.time()
        return max(0.0, min(soonest, self.max_interval))

    def _slot_if_due(self, entry: Any, now: datetime) -> str | None:
        name, align = entry.name, self.settings.align_intervals
        if name not in self.last_slot:
            # Seen for the first time: go on from the last slot sent, or, for an entry never
            # sent, do not fire a past occurrence (like stock beat). But a one-off's only
            # occurrence is never taken as past: seen first by a leader elected after its
            # time (a failover), it is sent within the grace, or reported missed.
            seed = slots.slot_for(entry.schedule, now, align_intervals=align)
            if isinstance(entry.schedule, slots.Once):
                seed = None
            stored = self._stored_slots.get(name) if seed else None
            self.last_slot[name] = stored or seed or ""
        slot, wait = slots.due_state(
            entry.schedule,
            now,
            self.last_slot[name] or None,
            align_intervals=align,
            max_wait=LOOK_AT_LEAST_EVERY,
        )
        if slot is None and self.last_slot[name] == "":
            return self._unaligned_slot(entry, now)
        self._look_at(name, now.timestamp() + wait)
        if slot is not None and _age(slot, now) > self.settings.grace:
            return self._late(entry, slot)
        return slot

    def _late(self, entry: Any, slot: str) -> str | None:
        if self.settings.entry_catch_up(entry)[0] != "none":
            return slot  # pglock_beat_catch_up: the newest slot is sent however late
        self.last_slot[entry.name] = slot  # missed while no replica was leading: not sent
        logger.info(
            "slot %s of %s was missed (older than %.0f s): not sent",
            slot,
            entry.name,
            self.settings.grace,
            extra={"action": "pglock_beat_missed", "entry": entry.name, "slot": slot},
        )
        return None

    def _unaligned_slot(self, entry: Any, now: datetime) -> str | None:
        # Celery's own phase (pglock_beat_align_intervals = False, or unknown schedules):
        # the slot is this process's fire time, so replicas do not share it.
        is_due, wait = entry.is_due()
        self._look_at(entry.name, now.timestamp() + min(wait, self.max_interval))
        return slots.format_slot(now) if is_due else None

    def _missed_before(self, entry: Any, slot: str) -> list[str]:
        """Catch-up ``all``: the slots after the last one sent and before ``slot``, oldest
        first, so that at most ``pglock_beat_catch_up_limit`` go out with ``slot``."""
        policy, limit = self.settings.entry_catch_up(entry)
        last = self.last_slot.get(entry.name) or ""
        if policy != "all" or limit < 2 or not last:
            return []
        before = slots.parse_slot(slot) - timedelta(seconds=1)
        missed, more = slots.slots_since(
            entry.schedule,
            before,
            last,
            limit=limit - 1,
            align_intervals=self.settings.align_intervals,
        )
        if missed:
            logger.info(
                "catching up %d missed slot(s) of %s from %s%s",
                len(missed),
                entry.name,
                missed[0],
                " (older ones not sent: pglock_beat_catch_up_limit)" if more else "",
                extra={"action": "pglock_beat_catch_up", "entry": entry.name, "slot": missed[0]},
            )
        return missed


def enabled(entry: Any, now: datetime) -> bool:
    """Respect django-celery-beat's per-entry switches (enabled, start time, expiry)."""
    model = getattr(entry, "model", None)
    if model is None:
        return True
    if not getattr(model, "enabled", True):
        return False
    start, expires = getattr(model, "start_time", None), getattr(model, "expires", None)
    if start is not None and start > now:
        return False
    return not (expires is not None and expires < now)


def _age(slot: str, now: datetime) -> float:
    try:
        return (now - slots.parse_slot(slot)).total_seconds()
    except ValueError:
        return 0.0
