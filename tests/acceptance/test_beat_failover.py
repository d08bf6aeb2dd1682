"""The beat leader dies or freezes mid-run: a standby takes over, no slot runs twice.

Bounds on timing are deadlines, generous for loaded CI machines; the sub-second takeover
target is measured by ``benchmarks/beat_failover.py``, not asserted here.
"""

from __future__ import annotations

import math
import socket
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_pglock.beat._scheduler import STANDBY_POLL
from tests.acceptance.beat_support import (
    Scenario,
    Send,
    duplicates,
    missing_slots,
    promoted_at,
    slot_epoch,
)
from tests.fixtures.procs import Proc, wait_until

# Run alone (serial): it times faults against the beat lease. Its bounds are guarantees, not
# speeds: a standby takes over within the lease of a frozen leader, at once after a killed
# one (guarantee 6); TAKEOVER_MARGIN is room on top of those that a loaded machine does not
# use up. The takeover's speed is a figure of benchmarks/beat_failover.py (docs/benchmarks.md §2).
pytestmark = [pytest.mark.acceptance, pytest.mark.serial]

WARM_SLOTS = 5  # slots run before the fault
AFTER_SLOTS = 5  # slots run after it
TAKEOVER_MARGIN = 3.0  # seconds of slack on top of what the design promises


@dataclass(frozen=True)
class Fault:
    """What a fault did: when it hit whom, and the new leader's first claim."""

    at: float  # epoch seconds
    old: Proc
    first_new: Send
    lease: float


def first_send_by_other(scenario: Scenario, old: Proc, after: float) -> Send | None:
    """The first claim made after ``after`` by a replica other than ``old``."""
    later = [s for s in scenario.sends() if s.pid != old.pid and s.claimed_at.timestamp() > after]
    return min(later, key=lambda send: send.claimed_at, default=None)


def wait_for_new_leader(scenario: Scenario, old: Proc, after: float, timeout: float) -> Send:
    """Wait for the first claim by a replica other than ``old`` made after ``after``."""
    found = wait_until(
        lambda: first_send_by_other(scenario, old, after),
        timeout=timeout,
        message="a new leader's send",
    )
    assert found is not None
    return found


def stopped(proc: Proc) -> bool:
    """Whether SIGSTOP has taken effect (state T in /proc)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def kill_leader(scenario: Scenario) -> Fault:
    """SIGKILL the leader just after it sent a slot; wait for the run to go on."""
    scenario.wait_slots(WARM_SLOTS)
    old = scenario.leader()
    latest = max(s.slot for s in scenario.sends())
    wait_until(lambda: max(s.slot for s in scenario.sends()) > latest, message="a fresh send")
    at = time.time()
    old.kill()
    first_new = wait_for_new_leader(scenario, old, at, timeout=15)
    scenario.wait_slots(AFTER_SLOTS, after=at)
    return Fault(at, old, first_new, scenario.spec.lease)


def freeze_leader(scenario: Scenario) -> Fault:
    """SIGSTOP the leader for twice its lease, then SIGCONT it; wait for the run to go on."""
    scenario.wait_slots(WARM_SLOTS)
    old = scenario.leader()
    lease = scenario.spec.lease
    old.freeze()
    wait_until(lambda: stopped(old), timeout=5, message="the leader to stop")
    at = time.time()  # a claim made while SIGSTOP was on its way predates the freeze
    first_new = wait_for_new_leader(scenario, old, at, timeout=lease + 15)
    time.sleep(max(0.0, at + 2 * lease - time.time()))  # the fault's length, not a wait
    old.thaw()
    old.wait_for_log("stepped down", timeout=15)
    scenario.wait_slots(AFTER_SLOTS, after=time.time())
    return Fault(at, old, first_new, lease)


@pytest.mark.parametrize("scenario", ["kill"], indirect=True)
def test_standby_sends_the_next_slot_after_the_leader_is_killed(scenario: Scenario) -> None:
    """After SIGKILL of the leader, a standby claims the next due slot promptly."""
    fault = scenario.once("kill", lambda: kill_leader(scenario))

    assert slot_epoch(fault.first_new.slot) <= math.floor(fault.at) + 1
    assert fault.first_new.lateness < TAKEOVER_MARGIN


@pytest.mark.parametrize("scenario", ["kill-pooled"], indirect=True)
def test_behind_a_pooler_a_killed_leader_is_replaced_within_its_lease(scenario: Scenario) -> None:
    """Behind PgBouncer in transaction pooling the leader holds a row, not a session: a
    SIGKILLed leader's row frees when its lease runs out, and a standby polls it (every
    half second at most) and claims the due slot at once: lease + 1 s, plus slack."""
    fault = scenario.once("kill", lambda: kill_leader(scenario))

    takeover = fault.first_new.claimed_at.timestamp() - fault.at

    assert takeover < fault.lease + 1.0 + TAKEOVER_MARGIN
    assert "beat leader election on rows" in scenario.proc_of(fault.first_new).log_text()


@pytest.mark.parametrize("scenario", ["kill", "kill-pooled"], indirect=True)
def test_no_slot_runs_twice_when_the_leader_is_killed(scenario: Scenario) -> None:
    """Killing the leader mid-run makes no slot execute twice."""
    scenario.once("kill", lambda: kill_leader(scenario))

    assert {} == duplicates(scenario.executed_slots())


@pytest.mark.parametrize("scenario", ["kill-pooled"], indirect=True)
def test_behind_a_pooler_only_slots_due_before_the_takeover_are_missing(
    scenario: Scenario,
) -> None:
    """On rows nobody leads from the kill until the row's lease ran out: slots are missing
    only between the kill and the new leader's first claim."""
    fault = scenario.once("kill", lambda: kill_leader(scenario))

    missing = missing_slots(scenario.executed_slots())
    takeover = fault.first_new.claimed_at.timestamp()

    assert [] == [s for s in missing if not fault.at - 1 <= s <= takeover]


@pytest.mark.parametrize("scenario", ["kill"], indirect=True)
def test_at_most_the_in_flight_slot_is_lost_when_the_leader_is_killed(scenario: Scenario) -> None:
    """Only the slot due at the moment of the kill may be missing from the run."""
    fault = scenario.once("kill", lambda: kill_leader(scenario))

    missing = missing_slots(scenario.executed_slots())

    assert set(missing) <= {math.floor(fault.at)}


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_standby_takes_over_within_the_lease_when_the_leader_freezes(scenario: Scenario) -> None:
    """A SIGSTOPped leader is replaced within its lease (plus slack): a standby claims."""
    fault = scenario.once("freeze", lambda: freeze_leader(scenario))

    takeover = fault.first_new.claimed_at.timestamp() - fault.at

    assert takeover < fault.lease + TAKEOVER_MARGIN


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_woken_leader_sends_nothing(scenario: Scenario) -> None:
    """After SIGCONT, the old leader makes no claim: every later slot has another sender."""
    fault = scenario.once("freeze", lambda: freeze_leader(scenario))

    old_pid, frozen_at = fault.old.pid, fault.at
    late = [
        s for s in scenario.sends() if s.pid == old_pid and s.claimed_at.timestamp() > frozen_at
    ]

    assert [] == late


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_woken_leader_logs_that_it_stepped_down(scenario: Scenario) -> None:
    """The old leader learns on waking that it lost leadership, and says so, naming its
    host and pid (two replicas on one host must not look alike)."""
    fault = scenario.once("freeze", lambda: freeze_leader(scenario))

    replica = f"beat replica {socket.gethostname()} (pid {fault.old.pid})"
    assert f"{replica} stepped down as leader" in fault.old.log_text()
    assert f"{replica} is now the leader" in fault.old.log_text()


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_no_slot_runs_twice_when_the_leader_freezes(scenario: Scenario) -> None:
    """Freezing and waking the leader makes no slot execute twice."""
    scenario.once("freeze", lambda: freeze_leader(scenario))

    assert {} == duplicates(scenario.executed_slots())


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_only_slots_due_while_nobody_led_are_missing(scenario: Scenario) -> None:
    """Slots are missing only between the freeze and the new leader's first claim."""
    fault = scenario.once("freeze", lambda: freeze_leader(scenario))

    missing = missing_slots(scenario.executed_slots())
    takeover = fault.first_new.claimed_at.timestamp()

    assert [] == [s for s in missing if not fault.at - 1 <= s <= takeover]


@pytest.mark.parametrize("scenario", ["freeze", "freeze-pooled"], indirect=True)
def test_new_leader_sends_the_slot_that_fell_due_before_it_took_over(scenario: Scenario) -> None:
    """The slot due when a standby was promoted runs (late), not skipped as already seen:
    the new leader's first claim is the slot of the second it was promoted in, or of the
    next when its first look as leader (a standby looks every ``STANDBY_POLL``) fell
    there; on rows a promotion comes at any phase of the second (its poll, the row's
    renewals), on an advisory lock mostly early in it."""
    fault = scenario.once("freeze", lambda: freeze_leader(scenario))

    promoted = promoted_at(scenario.proc_of(fault.first_new))
    executed = {slot_epoch(slot) for slot in scenario.executed_slots()}
    first = slot_epoch(fault.first_new.slot)

    assert first in {math.floor(promoted), math.floor(promoted + STANDBY_POLL)}
    assert first in executed
