"""The chaos campaign's fault schedule: drawn up front, the same for the same seed."""

from __future__ import annotations

import itertools

from tests.chaos.faults import INJECTORS, KINDS, MAX_GAP, MIN_GAP, Fault, draw_schedule


def test_the_same_seed_draws_the_same_schedule() -> None:
    """Two draws from one seed give identical faults: times, kinds and every choice."""
    assert draw_schedule(7, 120) == draw_schedule(7, 120)


def test_different_seeds_draw_different_schedules() -> None:
    """Seeds 1 and 2 do not share a schedule."""
    assert draw_schedule(1, 120) != draw_schedule(2, 120)


def test_faults_come_every_two_to_four_seconds_within_the_phase() -> None:
    """The first fault and every gap after it fall in [2, 4] s; none after the phase ends."""
    faults = draw_schedule(11, 120)
    times = [0.0] + [fault.at for fault in faults]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert all(MIN_GAP - 0.001 <= gap <= MAX_GAP + 0.001 for gap in gaps)
    assert faults[-1].at < 120
    assert 30 <= len(faults) <= 60


def test_a_shorter_campaign_replays_the_start_of_a_longer_one() -> None:
    """A seed's 40-s schedule is the first 40 s of its 120-s schedule."""
    assert draw_schedule(5, 40) == [fault for fault in draw_schedule(5, 120) if fault.at < 40]


def test_every_kind_is_drawn_and_can_be_injected() -> None:
    """Over a few campaigns every kind of the catalogue comes up; each has an injector."""
    drawn = {fault.kind for seed in range(5) for fault in draw_schedule(seed, 120)}
    assert set(KINDS) == drawn == set(INJECTORS)


def test_a_fault_picks_its_target_by_its_drawn_fraction() -> None:
    """``pick`` maps onto the candidates known when the fault fires, the last one included."""
    low = Fault(0, 1.0, "child_kill", pick=0.0, leader=False, length=1.0)
    high = Fault(0, 1.0, "child_kill", pick=0.999, leader=False, length=1.0)
    assert ("a", "c") == (low.choose(["a", "b", "c"]), high.choose(["a", "b", "c"]))
