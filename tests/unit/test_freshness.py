"""Freshness (``pglock_overdue_after``): which entries are overdue, and bad settings."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_pglock import ConfigurationError
from celery_pglock.beat.freshness import evaluate
from celery_pglock.beat.settings import BeatSettings

NOW = datetime(2026, 12, 1, 3, 30, tzinfo=timezone.utc)
DONE_AT = NOW - timedelta(hours=23)


def row(entry: str, pending: str | None, ok: str | None = "2026-11-30T02:00:00Z") -> tuple:
    return (entry, ok, DONE_AT if ok else None, pending, pending or ok)


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
