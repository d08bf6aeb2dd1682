"""A stock ``celery beat`` beside pglock replicas: what the worker side still guarantees.

Stock beat sends no ``pglock_slot`` header, so the worker cannot tell which slot its
messages belong to: they run as unslotted, mutually exclusive executions. The guarantees
that hold are the lock's (never two at once) and the ledger's for slotted messages (each
slot at most once, and every slot either runs or is reported as skipped). The entry's
task takes 0.3 s and two workers consume, so overlapping deliveries really compete.

Not guaranteed, and so not asserted: that slotted runs happen at all. Depending on the
stock beat's phase, its unslotted run may hold the lock every time a slotted message
arrives, and every slot is then skipped as ``locked``.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest

from tests.acceptance.beat_support import (
    Scenario,
    duplicates,
)
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.acceptance

SLOTS = 30


def accounted_slots(scenario: Scenario) -> dict[str, str]:
    """Each slot a pglock replica claimed -> "ran" or the skip reason, once settled."""
    outcome = dict.fromkeys(scenario.executed_slots(), "ran")
    for skip in scenario.skips():
        if skip["slot"] is not None:
            outcome.setdefault(skip["slot"], skip["reason"])
    return {send.slot: outcome[send.slot] for send in scenario.sends() if send.slot in outcome}


def settled(scenario: Scenario) -> dict[str, str]:
    """Wait until SLOTS claimed slots have an outcome; return them."""

    def enough() -> dict[str, str]:
        found = accounted_slots(scenario)
        return found if len(found) >= SLOTS else {}

    return wait_until(enough, timeout=90, interval=0.5, message=f"{SLOTS} settled slots")


def overlaps(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Pairs of execution ids whose [started, finished] intervals intersect."""
    done = sorted((r for r in rows if r["finished"] is not None), key=lambda r: r["started"])
    return [(a["id"], b["id"]) for a, b in pairwise(done) if b["started"] < a["finished"]]


@pytest.mark.parametrize("scenario", ["mixed"], indirect=True)
def test_slotted_slots_never_run_twice_beside_a_stock_beat(scenario: Scenario) -> None:
    """Slots sent by the pglock replicas execute at most once, whatever stock beat sends."""
    settled(scenario)

    assert {} == duplicates(scenario.executed_slots())


@pytest.mark.parametrize("scenario", ["mixed"], indirect=True)
def test_executions_never_overlap_beside_a_stock_beat(scenario: Scenario) -> None:
    """Slotted and stock-beat executions of the entry's task never run at the same time."""
    settled(scenario)

    assert [] == overlaps(scenario.executions())


@pytest.mark.parametrize("scenario", ["mixed"], indirect=True)
def test_every_claimed_slot_runs_or_is_reported_locked(scenario: Scenario) -> None:
    """No claimed slot vanishes: it ran, or was skipped as locked and recorded so."""
    outcomes = settled(scenario)

    assert set(outcomes.values()) <= {"ran", "locked"}


@pytest.mark.parametrize("scenario", ["mixed"], indirect=True)
def test_stock_beat_sends_are_handled_as_unslotted(scenario: Scenario) -> None:
    """The limit: stock-beat messages carry no slot; each runs, or is skipped if locked."""
    settled(scenario)

    ran = [row for row in scenario.executions() if row["slot"] is None]
    skipped = [row["reason"] for row in scenario.skips() if row["slot"] is None]

    assert ran or skipped
    assert set(skipped) <= {"locked"}
