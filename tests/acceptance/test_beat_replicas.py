"""Several ``celery beat`` replicas, one interval entry every second: each slot runs once."""

from __future__ import annotations

import pytest

from tests.acceptance.beat_support import (
    Scenario,
    duplicates,
    missing_slots,
)

pytestmark = pytest.mark.acceptance

SLOTS = 30
RABBITMQ_SLOTS = 12


@pytest.mark.parametrize("scenario", ["leader", "active"], indirect=True)
def test_each_slot_executes_exactly_once(scenario: Scenario) -> None:
    """Three replicas (leader election, or active-active) run every 1-s slot exactly once."""
    scenario.wait_slots(SLOTS)

    slots = scenario.executed_slots()

    assert {} == duplicates(slots)
    assert [] == missing_slots(slots)
    assert len(slots) >= SLOTS


@pytest.mark.parametrize("scenario", ["leader", "active"], indirect=True)
def test_each_slot_is_sent_once(scenario: Scenario) -> None:
    """Every claimed slot was published once and confirmed; no unslotted execution ran."""
    scenario.wait_slots(SLOTS)

    sends = scenario.sends()
    unslotted = [row for row in scenario.executions() if row["slot"] is None]

    assert [] == [send for send in sends if send.sends != 1]
    assert [] == [send.slot for send in sends[:-2] if send.sent_at is None]
    assert [] == unslotted


@pytest.mark.parametrize("scenario", ["leader"], indirect=True)
def test_only_the_leader_sends(scenario: Scenario) -> None:
    """With leader election on, one replica makes every claim while nothing fails."""
    scenario.wait_slots(SLOTS)

    senders = {send.sent_by for send in scenario.sends()}

    assert 1 == len(senders)


@pytest.mark.parametrize("scenario", ["rabbitmq"], indirect=True)
def test_each_slot_executes_exactly_once_on_rabbitmq(scenario: Scenario) -> None:
    """On RabbitMQ too, three leader-mode replicas run every slot exactly once."""
    scenario.wait_slots(RABBITMQ_SLOTS)

    slots = scenario.executed_slots()

    assert {} == duplicates(slots)
    assert [] == missing_slots(slots)
