"""The chaos campaign's invariant checker, on made-up histories."""

from __future__ import annotations

from typing import Any

import pytest

from tests.chaos import invariants, liveness
from tests.chaos.invariants import QuietState

LOCK = "ns:chaos.long"


def execution(token: int, acquired: float, **fields: Any) -> dict[str, Any]:
    """An execution row as ``tests.chaos.chaosapp`` records it (both writes accepted)."""
    row: dict[str, Any] = {
        "lock_name": LOCK,
        "slot": f"slot-{token}",
        "token": token,
        "pid": 100 + token,
        "acquired_at": acquired,
        "start_check_at": acquired,
        "start_lost": False,
        "start_result": "accepted",
        "start_write_at": acquired + 0.01,
        "end_check_at": acquired + 1.0,
        "end_lost": False,
        "end_result": "accepted",
        "end_write_at": acquired + 1.01,
        "ended_at": acquired + 1.02,
    }
    row.update(fields)
    return row


def writes_of(*rows: dict[str, Any]) -> list[dict[str, Any]]:
    """The accepted writes of ``rows`` in commit order (by write time)."""
    found = [
        {"resource": LOCK, "token": r["token"], "kind": kind, "task_id": None, "at": at}
        for r in rows
        for kind in ("start", "end")
        if r[f"{kind}_result"] == "accepted" and (at := r[f"{kind}_write_at"]) is not None
    ]
    found.sort(key=lambda w: w["at"])
    return [{**w, "id": number} for number, w in enumerate(found, 1)]


# -- (b) fences ----------------------------------------------------------------------------


def test_fenced_writes_in_token_order_pass() -> None:
    """Accepted writes whose tokens never decrease (one token twice) are fine."""
    writes = [
        {"id": i, "resource": LOCK, "token": t, "kind": "x", "task_id": None}
        for i, t in enumerate([3, 3, 5, 9], 1)
    ]
    assert [] == invariants.fences(writes)


def test_a_smaller_token_accepted_after_a_larger_one_is_a_violation() -> None:
    """Token 4 accepted after token 5 wrote: invariant (b), naming both."""
    writes = [
        {"id": i, "resource": LOCK, "token": t, "kind": "end", "task_id": f"t{t}"}
        for i, t in enumerate([5, 4], 1)
    ]
    [found] = invariants.fences(writes)
    assert "b" == found.invariant
    assert "token 4" in found.text
    assert "token 5" in found.text


# -- (c) overlaps ----------------------------------------------------------------------------


def test_executions_one_after_the_other_do_not_overlap() -> None:
    """The later token was granted after the earlier one's last write: nothing to judge."""
    rows = [execution(1, 0.0), execution(2, 5.0)]
    found, seen = invariants.overlaps(rows, writes_of(*rows))
    assert ([], invariants.Overlaps()) == (found, seen)


def test_a_frozen_holder_that_learned_it_lost_and_was_refused_is_fenced_out() -> None:
    """Frozen past its lease, the earlier holder wakes, learns it lost, its write is refused."""
    frozen = execution(
        1,
        0.0,
        end_check_at=9.0,
        end_lost=True,
        end_result="refused",
        end_write_at=9.1,
        ended_at=9.2,
    )
    newer = execution(2, 5.0)
    found, seen = invariants.overlaps([frozen, newer], writes_of(frozen, newer))
    assert ([], 1) == (found, seen.fenced_out)


def test_a_holder_told_held_after_a_newer_grant_is_a_violation() -> None:
    """``check()`` said "held" after token 2 was granted: invariant (c), with both tokens."""
    fooled = execution(
        1, 0.0, end_check_at=9.0, end_lost=False, end_result="refused", end_write_at=9.1
    )
    newer = execution(2, 5.0)
    [found], _ = invariants.overlaps([fooled, newer], writes_of(fooled, newer))
    assert "c" == found.invariant
    assert "token 1" in found.text
    assert "token 2" in found.text


def test_a_check_before_the_newer_grant_could_not_know() -> None:
    """Checked at 4.9 (held), token 2 granted at 5.0, write refused at 5.1: no violation."""
    racing = execution(
        1, 0.0, end_check_at=4.9, end_lost=False, end_result="refused", end_write_at=5.1
    )
    newer = execution(2, 5.0)
    found, seen = invariants.overlaps([racing, newer], writes_of(racing, newer))
    assert ([], 1) == (found, seen.fenced_out)


def test_an_overlap_without_a_write_is_counted_not_judged() -> None:
    """Killed before its end write (no end write, no end): an overlap without effect."""
    killed = execution(1, 0.0, end_check_at=None, end_result=None, end_write_at=None, ended_at=None)
    newer = execution(2, 5.0)
    found, seen = invariants.overlaps([killed, newer], writes_of(killed, newer))
    assert ([], 1, 0) == (found, seen.silent, seen.fenced_out)


def test_a_write_accepted_before_the_newer_holders_first_write_is_counted() -> None:
    """Accepted at 5.05, after the grant at 5.0 but before token 2 wrote at 5.06."""
    early = execution(1, 0.0, end_check_at=5.02, end_lost=True, end_write_at=5.05)
    newer = execution(2, 5.0, start_write_at=5.06)
    found, seen = invariants.overlaps([early, newer], writes_of(early, newer))
    assert ([], 1) == (found, seen.before_first_write)
    assert [] == invariants.fences(writes_of(early, newer))


# -- (d) after the quiet period ------------------------------------------------------------------


def state(**fields: Any) -> QuietState:
    base: dict[str, Any] = {
        "locks": [],
        "sessions": [],
        "running": [],
        "open_executions": [],
        "alive": {10, 20, 30},
        "beat_pids": {30},
        "names": {1: LOCK, 2: "ns:beat-leader"},
        "leader_lock": "ns:beat-leader",
        "pool_size": 4,
        "pooler_user": "pooler",
    }
    base.update(fields)
    return QuietState(**base)


def test_locks_of_live_running_tasks_and_the_live_leader_pass() -> None:
    """The lock of a task running in a live process and the live leader's lock are fine."""
    locks = [
        {"key": 1, "backend": 7, "application_name": "pglock 10 t1 host", "usename": "x"},
        {
            "key": 2,
            "backend": 8,
            "application_name": "celery-pglock beat leader 30@host",
            "usename": "x",
        },
    ]
    running = [{"lock_name": LOCK, "pid": 10, "token": 3}]
    assert [] == invariants.quiet(state(locks=locks, open_executions=running))


def test_a_lock_no_live_task_runs_is_a_violation() -> None:
    """A task lock held while no live process runs that task: invariant (d)."""
    locks = [{"key": 1, "backend": 7, "application_name": "pglock 99 t1 host", "usename": "x"}]
    [found] = invariants.quiet(state(locks=locks))
    assert ("d", True) == (found.invariant, LOCK in found.text)


def test_a_running_row_without_a_live_holder_is_a_violation() -> None:
    """A ``running`` row whose backend does not hold its lock: invariant (d)."""
    rows = [
        {"lock_name": LOCK, "slot": "s", "token": 3, "pid": 10, "backend_pid": 7, "held": False}
    ]
    [found] = invariants.quiet(state(running=rows))
    assert "left running" in found.text


def test_sessions_are_counted_per_live_process_within_the_pool_size() -> None:
    """Four sessions per worker process, five for a beat; the pooler's are not ours."""
    sessions = [
        *(
            {"backend": b, "application_name": "celery-pglock 10@h", "usename": "x"}
            for b in range(4)
        ),
        *(
            {"backend": b, "application_name": "celery-pglock beat leader 30@h", "usename": "x"}
            for b in range(5)
        ),
        *(
            {"backend": b, "application_name": "celery-pglock 10@h", "usename": "pooler"}
            for b in range(9)
        ),
    ]
    checked = state(sessions=sessions)
    assert [] == invariants.quiet(checked)
    assert {10: 4, 30: 5} == checked.counts


def test_too_many_sessions_or_a_dead_owner_are_violations() -> None:
    """Five sessions of one worker process, one of a dead process: two violations."""
    sessions = [
        *(
            {"backend": b, "application_name": "celery-pglock 10@h", "usename": "x"}
            for b in range(5)
        ),
        {"backend": 9, "application_name": "pglock 99 t host", "usename": "x"},
    ]
    texts = [violation.text for violation in invariants.quiet(state(sessions=sessions))]
    assert 2 == len(texts)
    assert any("session of dead or orphaned process 99" in text for text in texts)
    assert any("process 10 has 5 library sessions (> 4)" in text for text in texts)


# -- (e) sends, (f) liveness ----------------------------------------------------


def claim(slot: str, sends: int = 1) -> dict[str, Any]:
    return {"entry": "short", "slot": slot, "lock_name": LOCK, "sent_by": "h:30", "sends": sends}


def test_one_send_per_slot_passes_and_a_second_sender_does_not() -> None:
    """Slot s1 sent once; slot s2 sent by two replicas with one claim: invariant (e)."""
    published = [
        {"entry": "short", "slot": "s1", "task_id": "a", "pid": 30},
        {"entry": "short", "slot": "s2", "task_id": "b", "pid": 30},
        {"entry": "short", "slot": "s2", "task_id": "c", "pid": 31},
    ]
    [found] = invariants.sends(published, [claim("s1"), claim("s2")], [], {30, 31})
    assert ("e", True) == (found.invariant, "s2" in found.text)


def test_a_documented_resend_may_send_a_slot_twice() -> None:
    """A claim re-sent by beat (sends 2) may reach the workers as two messages."""
    published = [
        {"entry": "short", "slot": "s1", "task_id": "a", "pid": 30},
        {"entry": "short", "slot": "s1", "task_id": "b", "pid": 31},
    ]
    assert [] == invariants.sends(published, [claim("s1", sends=2)], [], {30, 31})


def test_workers_seeing_more_messages_than_were_sent_is_a_violation() -> None:
    """A task id for slot s1 that no send accounts for: invariant (e)."""
    published = [{"entry": "short", "slot": "s1", "task_id": "a", "pid": 30}]
    seen = [{"lock_name": LOCK, "slot": "s1", "task_id": "zzz"}]
    [found] = invariants.sends(published, [claim("s1")], seen, {30})
    assert "2 messages" in found.text


# -- (f) the longest stretch without a success ------------------------------------------------

SHORT = liveness.Timing(lease=2.0, interval=1.0, run=0.1)  # recovery 3.1 s, bound 5.1 s
WINDOW = (0.0, 60.0)


def gaps(successes: list[float], *disruptions: liveness.Disruption) -> list[liveness.Gap]:
    return liveness.entry_gaps("short", successes, WINDOW, disruptions, SHORT)


def test_an_entry_succeeding_every_second_keeps_its_bound() -> None:
    """Successes a second apart, the window's edges included: no stretch over its bound."""
    found = gaps([0.5 + n for n in range(60)])

    assert [] == liveness.over_bound(found)
    assert 1.0 == pytest.approx(liveness.worst(found).seconds)  # type: ignore[union-attr]


def test_a_stretch_without_success_past_its_bound_is_a_violation() -> None:
    """8 s without a success, nothing in between to explain it: over the 5.1-s bound."""
    [late] = liveness.over_bound(gaps([1.0, 2.0, 10.0, *range(11, 60)]))

    assert (2.0, 10.0, 5.1) == (late.start, late.end, pytest.approx(late.allowed))
    assert "short: 8.0 s without a success" in str(late)


def test_time_postgresql_was_unreachable_is_deducted() -> None:
    """The same stretch with PostgreSQL down 4 s inside it: 4 s left, within the bound
    of one fault (8.2 s); the outage spans no more than it covers."""
    down = liveness.Disruption(3.0, 7.0, "pg restart", unreachable=True)
    found = gaps([1.0, 2.0, 10.0, *range(11, 60)], down)

    [stretch] = [gap for gap in found if gap.start == 2.0]
    assert [] == liveness.over_bound(found)
    assert (4.0, 1) == (stretch.seconds, stretch.faults)


def test_each_fault_in_between_allows_one_more_recovery() -> None:
    """Two attempts lost in a 10-s stretch: bound 3 x 3.1 + 2 s; one alone is not enough."""
    lost = [liveness.Disruption(at, at, "attempt lost") for at in (3.0, 6.0)]
    successes = [1.0, 11.0, *range(12, 60)]

    assert [] == liveness.over_bound(gaps(successes, *lost))
    assert 1 == len(liveness.over_bound(gaps(successes, lost[0])))


def test_a_slot_lost_with_no_newer_success_stays_open_to_the_window_end() -> None:
    """Successes stop at 50 s: the stretch runs to the window's end and is judged."""
    [late] = liveness.over_bound(gaps([float(n) for n in range(1, 51)]))

    assert (50.0, 60.0) == (late.start, late.end)


def test_a_superseded_slot_needs_no_accounting() -> None:
    """Slot 2 superseded (never succeeded), slot 3 succeeded: one 2-s stretch, fine."""
    found = gaps([1.0, 3.0, *range(4, 60)])

    assert [] == liveness.over_bound(found)


def test_disruptions_of_other_entries_do_not_count() -> None:
    """A PgBouncer restart behind the tx worker neither excuses nor explains short's stretch."""
    bouncer = liveness.Disruption(3.0, 9.0, "pgbouncer", frozenset({"tx"}), unreachable=True)

    assert 1 == len(liveness.over_bound(gaps([1.0, 2.0, 10.0, *range(11, 60)], bouncer)))


def test_idle_spans_are_where_no_consumer_was_up() -> None:
    """Two workers up 0-20 and 15-30, one again from 40: idle 30-40 and 50-60."""
    up = [(0.0, 20.0), (15.0, 30.0), (40.0, 50.0)]

    assert [(30.0, 40.0), (50.0, 60.0)] == liveness.idle_spans(up, WINDOW)


def test_slot_success_counts_succeeded_slots_of_the_entries_sent() -> None:
    """For the figures: 19 of the 20 slots sent succeeded."""
    sends = [claim(f"s{i}") for i in range(20)]
    ledger = [{"lock_name": LOCK, "slot": f"s{i}", "state": "succeeded"} for i in range(19)]
    assert (19, 20) == invariants.slot_success(sends, ledger, {"short"})


def test_with_no_defect_open_every_violation_counts() -> None:
    """D1-D4 are fixed: a `tx` slot left `scheduled` is a violation, not a known defect."""
    tx = invariants.Violation("g", "ns:chaos.tx 2026-01-01T00:00:00Z: left scheduled (token 1)")
    assert invariants.known_defect(tx) is None


def test_failover_gaps_and_the_largest_hole_between_slots() -> None:
    """Each loss is measured to the next election; slot holes in seconds."""
    assert [0.5, 2.0] == invariants.failover_gaps([10.0, 20.0], [5.0, 10.5, 22.0])
    slots = ["2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z", "2026-01-01T00:00:04Z"]
    assert 3.0 == invariants.largest_hole(slots)
