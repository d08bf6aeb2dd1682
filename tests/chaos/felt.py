"""What each beat entry felt of a campaign's faults, for invariant (f) (``liveness``).

From the campaign's record (the faults injected, with their times and targets, when each
worker was up, the ledger) to each entry's successes and disruptions. Each injected fault
that could cost the entry a run counts once:

- PostgreSQL restarted or failed over: every entry, unreachable while it was down;
- PgBouncer restarted: the entry whose worker goes through it (``tx``), unreachable
  meanwhile;
- the proxied worker cut off or blackholed: the entries of its queue (a blackhole makes
  PostgreSQL unreachable for it while it lasts: the messages it holds wait meanwhile);
- a worker killed: the entries of its queue;
- a pool process killed or frozen while it runs a task: that task's entry;
- a backend terminated: every entry, when it held a lock or led beat;
- a beat replica killed: every entry, when it led.

No worker of an entry's queue up (all killed, or starting again) makes the entry
unreachable too, without counting as one more fault.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tests.chaos import chaosapp
from tests.chaos.liveness import Disruption, Gap, Timing, entry_gaps, idle_spans

EVERY_ENTRY = None
OUTAGES = ("pg_restart_fast", "pg_restart_immediate", "pg_failover")
ENTRY_OF_TASK = {task: entry for entry, (task, _) in chaosapp.ENTRIES.items()}


@dataclass
class Record:
    """What the campaign saw, in epoch seconds."""

    window: tuple[float, float]  # the fault phase's start, the drain's start
    faults: list[dict[str, Any]]  # kind, epoch, took, target, detail
    workers: list[tuple[str, float, float]]  # (queue, up from, up to)
    queues: dict[str, str]  # entry -> the queue its messages go to
    worker_queues: dict[str, str]  # worker label (w1, wp, …) -> its queue
    behind_bouncer: frozenset[str] = frozenset()  # entries whose worker uses PgBouncer
    proxied_queue: str | None = None  # the queue of the worker behind the proxy
    leases: dict[str, float] = field(default_factory=dict)  # task -> pglock_lease


def judge(record: Record, ledger: list[dict[str, Any]]) -> dict[str, list[Gap]]:
    """Every stretch of every entry without a success, each judged against its bound."""
    found = {}
    for entry, (task, interval) in chaosapp.ENTRIES.items():
        rows = [row for row in ledger if row["entry"] == entry]
        if rows:
            timing = Timing(record.leases[task], interval, chaosapp.BODIES[task])
            felt = disruptions(record, entry)
            found[entry] = entry_gaps(entry, successes(rows), record.window, felt, timing)
    return found


def successes(rows: Iterable[dict[str, Any]]) -> list[float]:
    """When each succeeded slot's run ended (PostgreSQL's clock, this machine)."""
    return [
        _epoch(row["finished_at"])
        for row in rows
        if row["state"] == "succeeded" and row["finished_at"]
    ]


def disruptions(record: Record, entry: str) -> list[Disruption]:
    """The faults ``entry`` felt, and when no worker consumed its queue."""
    found = [felt for fault in record.faults if (felt := _felt(record, entry, fault))]
    queue = record.queues[entry]
    up = [(since, until) for name, since, until in record.workers if name == queue]
    found += [
        Disruption(a, b, "no worker up", frozenset({entry}), unreachable=True, counts=False)
        for a, b in idle_spans(up, record.window)
    ]
    return found


def _felt(record: Record, entry: str, fault: dict[str, Any]) -> Disruption | None:
    """How ``entry`` felt one injected fault, if at all."""
    kind, start, detail = fault["kind"], fault["epoch"], fault["detail"]
    if not fault["target"]:
        return None
    outage = start + fault["took"]
    queue = record.queues[entry]
    if kind in OUTAGES:
        return Disruption(start, outage, kind, EVERY_ENTRY, unreachable=True)
    if kind == "pgbouncer_restart" and entry in record.behind_bouncer:
        return Disruption(start, outage, kind, unreachable=True)
    if kind == "proxy_blackhole" and queue == record.proxied_queue:
        return Disruption(start, start + detail["seconds"], kind, unreachable=True)
    hits = (
        (kind == "proxy_cut" and queue == record.proxied_queue)
        or (kind == "worker_kill" and record.worker_queues[fault["target"].split()[-1]] == queue)
        or (kind in ("child_kill", "freeze") and ENTRY_OF_TASK.get(detail.get("task")) == entry)
        or (kind == "terminate_backend" and _mattered(detail))
        or (kind == "beat_kill" and detail.get("leader"))
    )
    return Disruption(start, start, kind) if hits else None


def _mattered(detail: dict[str, Any]) -> bool:
    """A terminated backend that held a lock (some entry's run) or led beat."""
    return bool(detail.get("holds_lock")) or " beat leader " in str(detail.get("session"))


def _epoch(moment: Any) -> float:
    if isinstance(moment, datetime):
        return moment.timestamp()
    return datetime.fromisoformat(str(moment)).timestamp()
