"""Scheduling policies without a database: their settings, and which slots beat catches up.

Beat runs on the fake clock and in-memory store of ``test_beat_unit``: a stored last slot
stands for the last slot sent before every replica went down.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest
from celery import Celery
from celery.schedules import crontab, schedule

from celery_pglock._config import TaskOptions
from celery_pglock._messages import coalesces
from celery_pglock._policy import overlap
from celery_pglock._slots import is_time_slot, slots_since
from celery_pglock.beat import PgLockScheduler
from celery_pglock.errors import ConfigurationError
from tests.unit.test_beat_unit import Clock, SimulatedScheduler, Store, clock, make_app

__all__ = ["clock"]  # the fake-clock fixture, shared with test_beat_unit

UTC = timezone.utc
NOW = datetime(2026, 3, 29, 0, 58, 20, tzinfo=UTC)  # 20 s into a minute: past the grace
LAST = "2026-03-29T00:53:00Z"  # the last minutely slot sent before the outage
MINUTELY = {"task": "unit.job", "schedule": 60.0}


def options(app: Celery, **attributes: Any) -> TaskOptions:
    @app.task(name="t", shared=False, **attributes)
    def t() -> None:
        """A task."""

    return TaskOptions.resolve(t, app.conf, app.main)


def restarted(clock: Clock, entry: dict[str, Any] = MINUTELY, **conf: Any) -> SimulatedScheduler:
    """A replica starting at NOW after an outage since LAST, having ticked once."""
    clock.now = NOW
    scheduler = SimulatedScheduler(make_app({"minutely": entry}, **conf), Store({"minutely": LAST}))
    scheduler.tick()
    return scheduler


# -- settings --------------------------------------------------------------------------


def test_coalesce_defaults_to_latest_for_beat_messages_only() -> None:
    """Unset, a message coalesces when beat sent it (it names an entry), not otherwise."""
    default = options(Celery("proj", set_as_current=False))

    assert (True, False) == (coalesces(default, "tick"), coalesces(default, None))


@pytest.mark.parametrize(("policy", "expected"), [("all", False), ("latest", True)])
def test_coalesce_setting_applies_to_every_slotted_message(policy: str, expected: bool) -> None:
    """Set per task, the policy applies with or without an entry."""
    chosen = options(Celery("proj", set_as_current=False), pglock_coalesce=policy)

    assert (expected, expected) == (coalesces(chosen, "tick"), coalesces(chosen, None))


def test_unknown_coalesce_policy_is_refused() -> None:
    """A misspelt policy fails naming the setting and the choices."""
    with pytest.raises(ConfigurationError, match="pglock_coalesce must be 'all'"):
        options(Celery("proj", set_as_current=False), pglock_coalesce="newest")


def test_max_lateness_must_be_positive() -> None:
    """pglock_max_lateness is seconds > 0 (or None)."""
    app = Celery("proj", set_as_current=False)
    app.conf.pglock_max_lateness = -5

    with pytest.raises(ConfigurationError, match="pglock_max_lateness"):
        options(app)


def test_overlap_and_concurrency_default_to_skip_and_one() -> None:
    """Unset, a message that finds its lock held is skipped, and one runs at a time."""
    default = options(Celery("proj", set_as_current=False))

    assert ("skip", 1) == (overlap(default, None), default.concurrency)


def test_overlap_and_concurrency_are_read_per_task_and_app_wide() -> None:
    app = Celery("proj", set_as_current=False)
    app.conf.pglock_overlap = "buffer_one"

    chosen = options(app, pglock_concurrency=3)

    assert ("buffer_one", 3) == (chosen.overlap, chosen.concurrency)


@pytest.mark.parametrize("policy", ["queue", "BUFFER_ONE", "", 1])
def test_unknown_overlap_policy_is_refused_naming_the_choices(policy: Any) -> None:
    with pytest.raises(
        ConfigurationError, match=r"pglock_overlap must be 'skip' .*'buffer_one' .* or 'allow'"
    ):
        options(Celery("proj", set_as_current=False), pglock_overlap=policy)


@pytest.mark.parametrize("limit", [0, -1, 65, True, "3", 2.0])
def test_concurrency_must_be_an_int_from_1_to_64(limit: Any) -> None:
    with pytest.raises(ConfigurationError, match="pglock_concurrency must be an int from 1 to 64"):
        options(Celery("proj", set_as_current=False), pglock_concurrency=limit)


def test_bad_catch_up_policy_fails_at_start_up() -> None:
    """An unknown app-wide pglock_beat_catch_up stops the scheduler from starting."""
    with pytest.raises(ConfigurationError, match="pglock_beat_catch_up must be one of"):
        PgLockScheduler(app=make_app(pglock_beat_catch_up="everything"), lazy=True)


def test_bad_catch_up_of_an_entry_fails_at_start_up() -> None:
    """An entry's own bad pglock_catch_up_limit is named at start-up."""
    entry = {**MINUTELY, "options": {"pglock_catch_up": "all", "pglock_catch_up_limit": 0}}

    with pytest.raises(ConfigurationError, match=r"beat_schedule\['minutely'\]"):
        PgLockScheduler(app=make_app({"minutely": entry}), lazy=True)


# -- slots -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slot", "expected"),
    [("2026-11-29T18:05:00Z", True), ("2026-11-29", False), ("2026-11-29T18:05:00Z\n", False)],
)
def test_time_slots_are_recognized(slot: str, expected: bool) -> None:
    """Only beat's fixed-width form counts as a time slot."""
    assert expected == is_time_slot(slot)


def test_slots_since_gives_the_newest_within_the_limit() -> None:
    """The newest `limit` occurrences after a slot, oldest first, and that more were left."""
    found = slots_since(schedule(60.0), NOW, LAST, limit=2)

    assert (["2026-03-29T00:57:00Z", "2026-03-29T00:58:00Z"], True) == found


def test_slots_since_follows_crontab_occurrences() -> None:
    """Crontab occurrences after a slot, in UTC."""
    found = slots_since(crontab(minute="*/2"), NOW, "2026-03-29T00:53:00Z", limit=10)

    assert (
        ["2026-03-29T00:54:00Z", "2026-03-29T00:56:00Z", "2026-03-29T00:58:00Z"],
        False,
    ) == found


# -- beat catch-up ---------------------------------------------------------------------


def test_catch_up_none_sends_no_missed_slot(clock: Clock) -> None:
    """'none': the newest slot, 20 s old (past the grace), is not sent; nor are older ones."""
    assert [] == restarted(clock).slots("minutely")


def test_catch_up_latest_sends_the_newest_missed_slot_once(clock: Clock) -> None:
    """'latest': the newest slot is sent however late; the older missed ones are not."""
    scheduler = restarted(clock, pglock_beat_catch_up="latest")
    clock.advance(1)
    scheduler.tick()

    assert ["2026-03-29T00:58:00Z"] == scheduler.slots("minutely")


def test_catch_up_all_sends_every_missed_slot_oldest_first(clock: Clock) -> None:
    """'all': every slot since the last one sent, oldest first, in one tick."""
    scheduler = restarted(clock, pglock_beat_catch_up="all")

    expected = [f"2026-03-29T00:5{minute}:00Z" for minute in range(4, 9)]
    assert expected == scheduler.slots("minutely")


def test_catch_up_all_sends_at_most_the_limit(clock: Clock) -> None:
    """'all' with a limit of 2: only the 2 newest missed slots are sent."""
    scheduler = restarted(clock, pglock_beat_catch_up="all", pglock_beat_catch_up_limit=2)

    assert ["2026-03-29T00:57:00Z", "2026-03-29T00:58:00Z"] == scheduler.slots("minutely")


def test_catch_up_of_an_entry_overrides_the_app(clock: Clock) -> None:
    """An entry's options.pglock_catch_up wins over the app default, and is not sent."""
    entry = {**MINUTELY, "options": {"pglock_catch_up": "latest", "queue": "q"}}
    scheduler = restarted(clock, entry, pglock_beat_catch_up="all")

    [(_, slot, _)] = scheduler.sent
    assert "2026-03-29T00:58:00Z" == slot


def test_entry_catch_up_option_is_not_sent(clock: Clock) -> None:
    """Per-entry pglock_* options are stripped from what goes to apply_async."""
    sent: list[dict[str, Any]] = []

    class Recording(SimulatedScheduler):
        def apply_async(self, entry: Any, *args: Any, **kwargs: Any) -> None:
            sent.append(dict(entry.options))

    clock.now = NOW
    entry = {**MINUTELY, "options": {"pglock_catch_up": "latest", "queue": "q"}}
    Recording(make_app({"minutely": entry}), Store({"minutely": LAST})).tick()

    assert ["q"] == [options["queue"] for options in sent]
    assert [] == [options for options in sent if "pglock_catch_up" in options]


def test_catch_up_all_advances_the_stored_slot_to_the_newest(clock: Clock) -> None:
    """After catching up, the stored state is the newest slot sent."""
    store = Store({"minutely": LAST})
    clock.now = NOW
    SimulatedScheduler(make_app({"minutely": MINUTELY}, pglock_beat_catch_up="all"), store).tick()

    assert "2026-03-29T00:58:00Z" == store.last["minutely"]


def test_catch_up_does_not_apply_to_an_entry_never_sent(clock: Clock) -> None:
    """An entry with no stored slot starts with the next occurrence, whatever the policy."""
    clock.now = NOW
    app = make_app({"minutely": MINUTELY}, pglock_beat_catch_up="all")
    scheduler = SimulatedScheduler(app, Store())
    scheduler.tick()

    assert [] == scheduler.slots("minutely")
