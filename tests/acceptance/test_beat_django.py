"""django-celery-beat's ``DatabaseScheduler`` with ``PgLockSchedulerMixin``, two replicas."""

from __future__ import annotations

import pytest

from tests.acceptance.beat_support import (
    Scenario,
    duplicates,
    missing_slots,
)

pytestmark = pytest.mark.acceptance

SLOTS = 30


@pytest.mark.parametrize("scenario", ["django"], indirect=True)
def test_each_slot_executes_exactly_once_with_django_celery_beat(scenario: Scenario) -> None:
    """Two DatabaseScheduler replicas with the mixin run each 1-s PeriodicTask slot once."""
    scenario.wait_slots(SLOTS)

    slots = scenario.executed_slots()

    assert {} == duplicates(slots)
    assert [] == missing_slots(slots)


@pytest.mark.parametrize("scenario", ["django"], indirect=True)
def test_django_entries_are_claimed_under_their_periodic_task_name(scenario: Scenario) -> None:
    """Claims name the PeriodicTask ("tick"), and only the leader makes them."""
    scenario.wait_slots(SLOTS)

    sends = scenario.sends()

    assert {"tick"} == {send.entry for send in sends}
    assert 1 == len({send.sent_by for send in sends})
