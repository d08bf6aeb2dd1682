"""Freshness (``pglock_overdue_after``): which entries are overdue, and bad settings."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_pglock import ConfigurationError, signals
from celery_pglock.beat._freshness import SLICE, FreshnessWatch, evaluate
from celery_pglock.beat._settings import BeatSettings

NOW = datetime(2026, 12, 1, 3, 30, tzinfo=timezone.utc)
DONE_AT = NOW - timedelta(hours=23)


def row(entry: str, pending: str | None, ok: str | None = "2026-11-30T02:00:00Z") -> dict[str, Any]:
    """A ``beat_freshness`` row."""
    done_at = DONE_AT if ok else None
    return {
        "entry": entry,
        "last_success": ok,
        "last_success_at": done_at,
        "first_pending": pending,
        "last_due": pending or ok,
    }


def test_a_slot_not_succeeded_past_the_deadline_is_overdue_by_the_rest() -> None:
    [late] = evaluate([row("billing", "2026-12-01T03:00:00Z")], {"billing": 600}, NOW)

    assert 1800 == late.pending_for
    assert 1200 == late.overdue_by


def test_a_slot_within_its_deadline_or_none_pending_is_not_overdue() -> None:
    found = evaluate(
        [row("soon", "2026-12-01T03:25:00Z"), row("fine", None)], {"soon": 600, "fine": 60}, NOW
    )

    assert [None, None] == [f.overdue_by for f in found]


def test_overdue_entries_come_first_most_overdue_first() -> None:
    rows = [
        row("a-fine", None),
        row("b-late", "2026-12-01T03:10:00Z"),
        row("c-later", "2026-12-01T02:00:00Z"),
    ]

    found = evaluate(rows, {"a-fine": 60, "b-late": 60, "c-later": 60}, NOW)

    assert ["c-later", "b-late", "a-fine"] == [f.entry for f in found]


def test_an_entry_that_never_succeeded_is_overdue_from_its_first_slot() -> None:
    [never] = evaluate([row("new", "2026-12-01T03:00:00Z", ok=None)], {"new": 60}, NOW)

    assert (None, 1740.0) == (never.last_success, never.overdue_by)


@pytest.mark.parametrize("value", [0, -5, "10m", True, [600]])
def test_an_invalid_deadline_fails_at_start_up_naming_what_is_valid(value: object) -> None:
    app = Celery("freshness", set_as_current=False)
    app.conf.pglock_dsn = "postgresql://127.0.0.1/x"
    app.conf.pglock_overdue_after = value

    with pytest.raises(ConfigurationError, match=r"seconds > 0, or None \(off\)"):
        BeatSettings.from_app(app)


def test_an_entry_with_an_invalid_deadline_fails_at_start_up_naming_it() -> None:
    app = Celery("freshness", set_as_current=False)
    app.conf.pglock_dsn = "postgresql://127.0.0.1/x"
    app.conf.beat_schedule = {
        "nightly": {"task": "t", "schedule": 60.0, "options": {"pglock_overdue_after": "soon"}}
    }

    with pytest.raises(ConfigurationError, match=r"beat_schedule\['nightly'\]\.options"):
        BeatSettings.from_app(app)


# -- when the leader looks ------------------------------------------------------------------

FAILING = "2026-12-01T03:30:00Z"  # NOW: the slot fell due and keeps failing


class Ledger:
    """The leader's look on a made-up ledger (an entry whose slot FAILING is pending) and
    a clock the test moves, as beat's ticks would."""

    def __init__(self, overdue_after: float) -> None:
        app = Celery("freshness", set_as_current=False)
        app.conf.pglock_dsn = "postgresql://127.0.0.1/x"
        self.entry = SimpleNamespace(
            name="billing", options={"pglock_overdue_after": overdue_after}
        )
        self.settings = BeatSettings.from_app(app)
        self.looks = 0
        self.clock = 100.0
        self.now = NOW
        self.watch = FreshnessWatch(self.settings, self.query, self, clock=lambda: self.clock)

    def query(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        self.looks += 1
        return [row("billing", FAILING)]

    def tick(self, after: float) -> None:
        """``after`` seconds later, a tick of the leader."""
        self.clock += after
        self.now += timedelta(seconds=after)
        self.watch.maybe_check({"billing": self.entry}, lambda e: "ns:billing", self.now)


def test_a_tick_a_few_ms_under_a_second_after_the_last_look_still_looks() -> None:
    """Beat wakes on the second give or take a few ms: no tick skips its look."""
    ledger = Ledger(overdue_after=600)

    for after in (0.2, 0.995, 0.996, 1.002):
        ledger.tick(after)

    assert 4 == ledger.looks


def test_the_overdue_alert_comes_at_the_deadline_not_a_tick_later(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 2.5-s deadline: beat wakes for it (wake_in) and that look reports the slot, a
    few ms past the deadline (overdue_seconds), once; the WARNING says 2.5 s, not 2 s."""
    ledger = Ledger(overdue_after=2.5)
    fired: list[float] = []

    def overdue(overdue_seconds: float, **_: Any) -> None:
        fired.append(overdue_seconds)

    signals.task_overdue.connect(overdue, weak=False)
    # The logger's own level: an app an earlier test configured may have set the root's
    # to ERROR.
    try:
        with caplog.at_level(logging.WARNING, logger="celery_pglock.beat"):
            ledger.tick(0.3)  # the first look after the slot fell due: pending, not overdue
            ledger.tick(ledger.watch.wake_in())
            ledger.tick(1.0)
    finally:
        signals.task_overdue.disconnect(overdue)

    assert 1 == len(fired)
    assert 0 < fired[0] < 0.1
    # (by its action: a pool thread of an earlier test may log a WARNING meanwhile)
    said = [r for r in caplog.records if getattr(r, "action", None) == "pglock_entry_overdue"]
    [warning] = [r.getMessage() for r in said]
    assert "(pglock_overdue_after 2.5 s;" in warning
    assert "s past its deadline" in warning


class Schedule:
    """A leader's look at a schedule of ``count`` entries (``e00000``, …), with
    ``pglock_overdue_after`` or not; the ledger says which slots are pending."""

    def __init__(self, count: int, *, overdue_after: float | None = 600) -> None:
        app = Celery("freshness-scale", set_as_current=False)
        app.conf.pglock_dsn = "postgresql://127.0.0.1/x"
        options = {"pglock_overdue_after": overdue_after} if overdue_after else {}
        self.entries = {
            name: SimpleNamespace(name=name, options=options)
            for name in (f"e{n:05d}" for n in range(count))
        }
        self.pending: dict[str, str] = {}  # entry -> its slot not yet succeeded
        self.looked: list[list[str]] = []  # the entries of each look, in turn
        self.clock = 100.0
        settings = BeatSettings.from_app(app)
        self.watch = FreshnessWatch(settings, self.query, self, clock=lambda: self.clock)

    def query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        self.looked.append(list(params["entries"]))
        return [row(entry, self.pending.get(entry)) for entry in params["entries"]]

    def tick(self) -> None:
        self.clock += 1.0
        self.watch.maybe_check(self.entries, lambda e: f"ns:{e.name}", NOW)


def test_a_look_at_a_large_schedule_reads_a_slice_and_every_entry_in_turn() -> None:
    """100,000 entries with a deadline cost a look of 100,000 every second (2 s each, issue
    34): a look reads at most SLICE of them, and every one is read within a round."""
    schedule = Schedule(2 * SLICE + SLICE // 2)

    for _ in range(3):
        schedule.tick()

    assert [SLICE, SLICE, SLICE // 2] == [len(look) for look in schedule.looked]
    assert sorted(schedule.entries) == sorted(name for look in schedule.looked for name in look)


def test_an_entry_sent_or_pending_is_read_at_every_look_whatever_the_turn() -> None:
    """Its alert comes at its deadline: an entry whose slot this leader just sent is read
    at the next look, and at each look after while its slot is pending."""
    schedule = Schedule(3 * SLICE)
    late = f"e{3 * SLICE - 1:05d}"  # the last turn's

    schedule.watch.sent([late])
    schedule.pending[late] = FAILING
    schedule.tick()
    schedule.tick()
    del schedule.pending[late]  # it succeeded
    schedule.tick()
    schedule.tick()  # a new round: the first slice again

    assert [True, True, True, False] == [late in look for look in schedule.looked]


def test_a_small_schedule_is_read_whole_at_every_look() -> None:
    """At SLICE entries or fewer a look reads every one, an entry added since included."""
    schedule = Schedule(10)

    schedule.tick()
    schedule.entries["new"] = SimpleNamespace(
        name="new", options=schedule.entries["e00000"].options
    )
    schedule.tick()

    assert [10, 11] == [len(look) for look in schedule.looked]


def test_entries_without_a_deadline_cost_no_query_and_no_read_of_every_entry() -> None:
    """Off (no pglock_overdue_after): a look reads at most a slice of the entries, and asks
    the ledger nothing."""
    schedule = Schedule(3 * SLICE, overdue_after=None)
    reads = 0
    entries = schedule.entries

    class Counted(dict[str, Any]):
        def __getitem__(self, name: str) -> Any:
            nonlocal reads
            reads += 1
            return entries[name]

    schedule.entries = Counted(entries)
    schedule.tick()

    assert [] == schedule.looked
    assert reads <= SLICE


def test_each_overdue_slot_is_reported_once_and_what_was_told_stays_one_per_entry() -> None:
    """Slot after slot overdue, each succeeding later: each one reported once, and the
    watch keeps one told slot an entry, not every slot it ever reported (it grew for good)."""
    schedule = Schedule(3, overdue_after=60)
    fired: list[tuple[str, str]] = []

    def overdue(entry: str, slot: str, **_: Any) -> None:
        fired.append((entry, slot))

    signals.task_overdue.connect(overdue, weak=False)
    try:
        for minute in range(5):
            slot = f"2026-12-01T03:{minute:02d}:00Z"  # over a minute before NOW: overdue
            schedule.pending["e00001"] = slot
            schedule.tick()
            schedule.tick()  # still pending: not reported again
            del schedule.pending["e00001"]  # it succeeded
            schedule.tick()
    finally:
        signals.task_overdue.disconnect(overdue)

    assert [("e00001", f"2026-12-01T03:{m:02d}:00Z") for m in range(5)] == fired
    assert len(schedule.watch._told) <= 1
