"""The final report: per task, what was due, what ran, what was skipped and why.

Computed from the rows of one run (``facts``), for the slots due inside its window:

- ``executions``: bodies that completed their (fenced) write; ``double_executions``: the
  ones beyond the first for the same slot, which the lock must keep at 0;
- ``skipped``: messages the lock turned away, by reason (``locked``: the task was still
  running, ``done``: the slot had already run);
- ``missed_slots``: due slots with neither an execution nor a skip;
- ``interrupted``: bodies killed mid-run; ``stale_writes_rejected``: bodies that woke up
  after their lease expired and whose write the fencing token refused.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from typing import Any

from celery_pglock.demo import _schedule as schedule
from celery_pglock.demo._chaos import LONG_TASK
from celery_pglock.demo._facts import Execution, Send
from celery_pglock.demo._runner import RunRecord

COUNTED = (
    "slots_due",
    "executions",
    "double_executions",
    "slots_run_twice",
    "skipped_total",
    "missed_slots",
    "interrupted",
    "stale_writes_rejected",
    "redelivered_executions",
)


def task_stats(task: schedule.DemoTask, record: RunRecord) -> dict[str, Any]:
    due = task.slots_between(record.start, record.end)
    window = set(due)
    runs = [e for e in record.facts.executions if e.task == task.name and e.slot in window]
    skips = [s for s in record.facts.skips if s.task == task.name and s.slot in window]
    ok_per_slot = Counter(e.slot for e in runs if e.outcome == "ok")
    accounted = {e.slot for e in runs} | {s.slot for s in skips}
    reasons = Counter(s.reason for s in skips)
    return {
        "every_s": task.every,
        "runs_for_s": task.runs_for,
        "slots_due": len(due),
        "executions": sum(ok_per_slot.values()),
        "double_executions": sum(n - 1 for n in ok_per_slot.values() if n > 1),
        "slots_run_twice": sum(1 for n in ok_per_slot.values() if n > 1),
        "skipped": dict(sorted(reasons.items())),
        "skipped_total": sum(reasons.values()),
        "missed_slots": sum(1 for slot in due if slot not in accounted),
        "interrupted": sum(1 for e in runs if e.outcome == "running"),
        "stale_writes_rejected": sum(1 for e in runs if e.outcome == "stale"),
        "redelivered_executions": sum(1 for e in runs if e.redelivered and e.outcome == "ok"),
        "max_parallel": max_parallel(runs, _deaths(record), record.end),
    }


def max_parallel(runs: Iterable[Execution], deaths: dict[int, float], end: float) -> int:
    """The most executions of one task that were running at the same moment.

    An execution that never finished ended when its process was killed (``deaths``), or
    else at the end of the run.
    """
    edges = []
    for run in runs:
        stop = run.finished if run.finished is not None else deaths.get(run.pid, end)
        edges += [(run.started, 1), (stop, -1)]
    current = peak = 0
    for _, step in sorted(edges, key=lambda edge: (edge[0], edge[1])):
        current += step
        peak = max(peak, current)
    return peak


def totals(tasks: dict[str, dict[str, Any]]) -> dict[str, Any]:
    summed: dict[str, Any] = {key: sum(t[key] for t in tasks.values()) for key in COUNTED}
    reasons: Counter[str] = Counter()
    for stats in tasks.values():
        reasons.update(stats["skipped"])
    summed["skipped"] = dict(sorted(reasons.items()))
    return summed


def beat_stats(record: RunRecord) -> dict[str, Any]:
    """Who sent the window's slots and how late (celery-pglock's send log)."""
    claimed = _sends_in_window(record)
    sends = [s for s in claimed if s.sent_at is not None]
    delays = [s.sent_at - schedule.slot_time(s.slot) for s in sends if s.sent_at is not None]
    return {
        "slots_sent": len(sends),
        "slots_claimed_not_sent": len(claimed) - len(sends),
        "slots_sent_again": sum(1 for s in sends if s.sends > 1),
        "senders": sorted({_pid(s.sent_by) for s in sends}),
        "send_delay_median_s": round(statistics.median(delays), 3) if delays else None,
    }


def failovers(record: RunRecord) -> list[dict[str, Any]]:
    """For each killed leader: how late the first slot due after the kill was sent."""
    found: list[dict[str, Any]] = []
    for event in record.events:
        if event.kind != "leader_killed":
            continue
        after = [s for s in _sends_in_window(record) if schedule.slot_time(s.slot) >= event.at]
        firsts = [
            min((s for s in after if s.task == t.name), key=_due, default=None)
            for t in schedule.TASKS
        ]
        delays = [
            (s.sent_at - _due(s), s) for s in firsts if s is not None and s.sent_at is not None
        ]
        if not delays:
            found.append({"killed_pid": event.pids[0], "new_leader_pid": None, "failover_s": None})
            continue
        worst, send = max(delays, key=lambda item: item[0])
        found.append(
            {
                "killed_pid": event.pids[0],
                "new_leader_pid": _pid(send.sent_by),
                "failover_s": round(worst, 3),
                "first_slot_after_kill": send.slot,
            }
        )
    return found


def freezes(record: RunRecord) -> list[dict[str, Any]]:
    """For each frozen worker: when another worker ran the long task, and what was fenced."""
    found = []
    for event in record.events:
        if event.kind != "worker_frozen":
            continue
        frozen = set(event.pids)
        later = [
            e.started - event.at
            for e in record.facts.executions
            if e.task == LONG_TASK.name and e.started > event.at and e.pid not in frozen
        ]
        stale = [e for e in record.facts.executions if e.pid in frozen and e.outcome == "stale"]
        found.append(
            {
                "frozen_pid": event.pids[0],
                "frozen_for_s": event.detail.get("frozen_for_s"),
                "was_running": event.detail.get("holding", []),
                "long_task_run_elsewhere_after_s": round(min(later), 2) if later else None,
                "stale_writes_rejected": len(stale),
            }
        )
    return found


def run_report(record: RunRecord) -> dict[str, Any]:
    spec = record.spec
    tasks = {task.name: task_stats(task, record) for task in schedule.TASKS}
    report: dict[str, Any] = {
        "mode": spec.mode,
        "lock": spec.locked,
        "beats": spec.beats,
        "workers": spec.workers,
        "duration_s": spec.duration,
        "broker": record.broker,
        "run_id": record.run_id,
        "tasks": tasks,
        "totals": totals(tasks),
        "redeliveries_injected": len(record.redelivered),
        "chaos": [event.as_dict(record.start) for event in record.events],
        "logs": record.log_dir.name,
    }
    if spec.locked:
        report["beat"] = beat_stats(record)
        report["failover"] = failovers(record)
    report["freezes"] = freezes(record)
    return report


def full_report(records: list[RunRecord], seed: int) -> dict[str, Any]:
    """The one JSON object ``--json`` prints; ``ok`` is false if a slot ran twice under lock."""
    runs = [run_report(record) for record in records]
    doubles = sum(r["totals"]["double_executions"] for r in runs if r["lock"])
    status = 1 if doubles else 0
    return {"ok": status == 0, "exit_status": status, "seed": seed, "runs": runs}


def _deaths(record: RunRecord) -> dict[int, float]:
    """When each process killed by ``--chaos`` died."""
    killed = (e for e in record.events if e.kind in ("leader_killed", "worker_killed"))
    return {pid: event.at for event in killed for pid in event.pids}


def _sends_in_window(record: RunRecord) -> list[Send]:
    names = {t.name: t for t in schedule.TASKS}
    return [
        s
        for s in record.facts.sends
        if s.task in names and record.start < schedule.slot_time(s.slot) <= record.end
    ]


def _due(send: Send) -> float:
    return schedule.slot_time(send.slot)


def _pid(sent_by: str) -> int | None:
    tail = sent_by.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None
