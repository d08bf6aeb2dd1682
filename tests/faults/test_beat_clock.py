"""Clock jumps under beat: stepped back it re-sends nothing, stepped forward it does not burst.

Unit level: the scheduler of ``tests/unit/test_beat_unit.py`` with its database replaced
by memory and one fake clock for ``datetime.now``, ``time.time`` and ``time.monotonic``.
The entry fires every 10 s (epoch-aligned slots).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta

import pytest
from celery import Celery

from tests.unit.test_beat_unit import (
    START,
    Clock,
    SimulatedScheduler,
    Store,
    install_clock,
    make_app,
    tick_until,
)

pytestmark = pytest.mark.faults

HOUR = timedelta(hours=1)


class JumpingClock(Clock):
    """Wall time that can jump (``jump``) while the monotonic clock only moves forward."""

    def __init__(self, now: datetime) -> None:
        super().__init__(now)
        self.mono = 1000.0

    def advance(self, seconds: float) -> None:
        super().advance(seconds)
        self.mono += seconds

    def jump(self, seconds: float) -> None:
        super().advance(seconds)

    def monotonic(self) -> float:
        return self.mono


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> JumpingClock:
    """Beat's wall clocks (datetime.now, time.time) and its monotonic clock."""
    fake = JumpingClock(START)
    install_clock(monkeypatch, fake)
    return fake


@pytest.fixture
def app() -> Iterator[Celery]:
    """One entry every 10 s."""
    app = make_app()
    yield app
    app.close()


@pytest.fixture
def running(app: Celery, clock: JumpingClock) -> SimulatedScheduler:
    """A scheduler that has been sending for a minute."""
    scheduler = SimulatedScheduler(app, Store(last={"every10": "2026-03-29T00:57:50Z"}))
    tick_until(scheduler, clock, START + timedelta(minutes=1))
    return scheduler


def test_clock_stepped_back_re_sends_nothing(
    running: SimulatedScheduler, clock: JumpingClock
) -> None:
    """Stepped back an hour, beat sends no slot it already sent (nor any older one)."""
    sent = list(running.slots())
    clock.jump(-3600)

    tick_until(running, clock, clock.now + timedelta(minutes=5))

    assert sent == running.slots()


def test_clock_stepped_back_goes_on_once_past_the_last_slot(
    running: SimulatedScheduler, clock: JumpingClock
) -> None:
    """Stepped back 30 s, beat resumes with the first slot after the last it sent, once each."""
    last = running.slots()[-1]
    clock.jump(-30)

    tick_until(running, clock, clock.now + timedelta(minutes=1))

    after = running.slots()[running.slots().index(last) + 1 :]
    assert after == sorted(set(after))
    assert after[0] > last
    assert 3 == len(after)


def test_clock_stepped_forward_sends_one_slot_not_a_burst(
    running: SimulatedScheduler, clock: JumpingClock
) -> None:
    """Stepped forward an hour, beat sends the current slot only, not the 360 it skipped."""
    before = len(running.slots())
    clock.jump(3600)

    running.tick()

    assert 1 == len(running.slots()) - before
    assert running.slots()[-1] == (clock.now - timedelta(seconds=clock.now.second % 10)).strftime(
        "%Y-%m-%dT%H:%M:%SZ"
    )


def test_forward_jump_corrected_back_never_sends_a_slot_twice(
    running: SimulatedScheduler, clock: JumpingClock
) -> None:
    """A forward jump NTP then undoes: slots stop until time catches up, none is sent twice."""
    clock.jump(3600)
    running.tick()
    clock.jump(-3600)

    tick_until(running, clock, clock.now + HOUR + timedelta(minutes=1))

    slots = running.slots()
    assert slots == sorted(set(slots))
