"""What the dashboard shows of the ledger: every entry at a glance (``overview``), one
entry's history over a window (``entry_history``), the audit trail (``audit_trail``).

Rows come from ``sql/web_queries.sql`` through the indexes of migration 10: the newest
rows of a lock name by creation time, whatever their slot's name (a time, ``manual:…``,
a caller's own), so that no slot is left out for not looking like a time. The strip of an
entry is its last ``STRIP`` slots: those its schedule says fell due (one with no row is
``missed``) and those sent by hand, in time order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from celery.schedules import crontab, schedule, solar

from celery_pglock import _controls as controls
from celery_pglock import _preview as preview
from celery_pglock import _slots as slots
from celery_pglock import ops
from celery_pglock.beat._freshness import entries_freshness
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.ops import Row
from celery_pglock.steering._apps import Schedule, known_lock_names, namespace
from celery_pglock.steering._reads import freshness_row
from celery_pglock.store.statements import Statements

STRIP = 48  # slots per entry on the overview
PER_PAGE = 50  # entries per page of the overview
STATS_WINDOW = timedelta(hours=24)
TIMELINE_LIMIT = 500  # bars drawn on an entry's timeline
PAGE = 50  # rows per page of an entry's table
SKIPS_LIMIT = 1000
MISSED = "missed"  # a slot its schedule says fell due, with no row: never claimed
NO_RECORD = "none"  # older than anything the ledger keeps of the entry
GRACE = timedelta(seconds=5)  # a slot due this recently may not have its row yet


def describe(sched: Any) -> str:
    """A schedule in words: ``every 5 min``, ``cron 0 3 * * * (Europe/Paris)``, …"""
    if isinstance(sched, crontab):
        names = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
        fields = " ".join(str(getattr(sched, f"_orig_{name}", "*")) for name in names)
        return f"cron {fields} ({slots.schedule_zone(sched)})"
    if isinstance(sched, solar):
        return f"solar {sched.event} at {sched.lat}, {sched.lon}"
    if isinstance(sched, schedule):
        every: timedelta = getattr(sched, "run_every", timedelta(0))
        return f"every {_span(every.total_seconds())}"
    return repr(sched)


def _span(seconds: float) -> str:
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size:.0f} {unit}"
    return f"{seconds:g} s"


@dataclass(frozen=True)
class Cell:
    """One slot on an entry's strip."""

    slot: str
    at: datetime
    state: str  # a run state, MISSED or NO_RECORD
    row: Row | None

    def as_json(self) -> Row:
        row = self.row or {}
        return {
            "slot": self.slot,
            "at": self.at,
            "state": self.state,
            "reason": row.get("reason"),
            "attempts": row.get("attempts"),
            "token": row.get("token"),
            "host": row.get("host"),
            "duration_seconds": row.get("duration_seconds"),
            "skips": row.get("skips", 0),
            "skip_reasons": row.get("skip_reasons") or {},
        }


def strip(
    sched: Any, rows: list[Row], now: datetime, *, align: bool, size: int = STRIP
) -> list[Cell]:
    """The last ``size`` slots of an entry, oldest first: its rows, and the slots its
    schedule says fell due that have none (``missed`` once the ledger knew the entry:
    from its oldest row's creation on)."""
    cells = {row["slot"]: Cell(row["slot"], _moment(row), row["state"], row) for row in rows}
    # Since when the ledger knows the entry: its rows' creation, not their slots' times (a
    # backfill writes old slots now, and the time between is not missed for it).
    oldest = min((row["created_at"] for row in rows), default=None)
    for at in due_times(sched, now - GRACE, size, align=align):
        slot = slots.format_slot(at)
        if slot not in cells:
            state = MISSED if oldest is not None and at >= oldest else NO_RECORD
            cells[slot] = Cell(slot, at, state, None)
    return sorted(cells.values(), key=lambda cell: (cell.at, cell.slot))[-size:]


def due_times(sched: Any, now: datetime, size: int, *, align: bool) -> list[datetime]:
    """The newest ``size`` times ``sched`` fell due at or before ``now``: by arithmetic for
    an aligned interval (its slots are multiples of it), else walking back occurrence by
    occurrence (``slots.slots_since``); none for a schedule this library cannot walk."""
    every = getattr(sched, "run_every", None)
    if (
        align
        and type(sched) is schedule
        and isinstance(every, timedelta)
        and every.total_seconds() >= 1
    ):
        newest = slots.interval_slot(now, every)
        return [newest - n * every for n in range(size)]
    try:
        due, _ = slots.slots_since(sched, now, "", limit=size, align_intervals=align)
    except Exception:  # noqa: BLE001 - a schedule this library cannot walk: rows only
        return []
    return [slots.parse_slot(slot) for slot in due]


def _moment(row: Row) -> datetime:
    """When a row's slot was: its time, or when its row was made (a slot named by hand)."""
    if slots.is_time_slot(row["slot"]):
        return slots.parse_slot(row["slot"])
    moment: datetime = row["created_at"]
    return moment


def _by_entry(rows: Iterable[Row]) -> dict[str, list[Row]]:
    found: dict[str, list[Row]] = {}
    for row in rows:
        found.setdefault(row["entry"], []).append(row)
    return found


def overview(
    app: Any,
    statements: Statements,
    *,
    page: int = 0,
    now: datetime | None = None,
) -> Row:
    """The beat entries at a glance, overdue first (then by name), ``PER_PAGE`` a page;
    the beat replicas; rogue senders. Every entry's freshness is looked at (the order
    needs it), the strips and rates only for the page's."""
    now = now or datetime.now(timezone.utc)
    entries = Schedule(app, statements)
    settings = BeatSettings.from_app(app)
    ns = namespace(app)
    known = known_lock_names(app)
    status = ops.status(statements, namespace=ns, known_names=known, limits=known, skips=0)
    looks = entries_freshness(statements, settings, entries.entries.values(), entries.lock_name)
    fresh = {f.entry: freshness_row(f) for f in looks}
    overdue = {name: row["overdue_seconds"] for name, row in fresh.items()}
    order = sorted(
        entries.entries,
        key=lambda name: (overdue.get(name) is None, -(overdue.get(name) or 0), name),
    )
    shown = order[page * PER_PAGE : (page + 1) * PER_PAGE]
    locks = {name: entries.lock_name(entries.entries[name]) for name in shown}
    params = {"lock_names": list(locks.values()), "entries": list(locks)}
    rows = _by_entry(statements.rows("web_strip", {**params, "limit": STRIP}))
    since = now - STATS_WINDOW
    stats = {row["entry"]: row for row in statements.rows("web_stats", {**params, "since": since})}
    successes = {row["entry"]: row for row in statements.rows("web_last_success", params)}
    view = controls.Target(statements.tables, ns, "")
    paused = {row["entry"]: row for row in controls.pauses(statements, view)}
    align = settings.align_intervals
    found = [
        _entry_row(
            entries.entries[name],
            locks[name],
            now=now,
            cells=strip(entries.entries[name].schedule, rows.get(name, []), now, align=align),
            stats=stats.get(name),
            success=successes.get(name),
            paused=paused.get(name),
            fresh=fresh.get(name),
            align=align,
        )
        for name in shown
    ]
    return {
        "namespace": ns,
        "generated_at": now,
        "total": len(order),
        "overdue": sum(1 for seconds in overdue.values() if seconds is not None),
        "paused": len(paused),
        "page": page,
        "per_page": PER_PAGE,
        "entries": found,
        "beat": status.beat,
        "rogue_sends": status.rogue,
        "entries_shadowed": entries.shadowed,
    }


def _entry_row(
    entry: Any,
    lock: str,
    *,
    now: datetime,
    cells: list[Cell],
    stats: Row | None,
    success: Row | None,
    paused: Row | None,
    fresh: Row | None,
    align: bool,
) -> Row:
    coming = preview.upcoming(entry.schedule, now, 1, align_intervals=align)
    finished = success["finished_at"] if success else None
    counted = (stats["succeeded"] + stats["failed"]) if stats else 0
    return {
        "entry": entry.name,
        "task": entry.task,
        "lock_name": lock,
        "schedule": describe(entry.schedule),
        "timezone": str(slots.schedule_zone(entry.schedule)),
        "next_slot": coming[0].slot if coming else None,
        "last_success": success["slot"] if success else None,
        "last_success_at": finished,
        "last_success_age_seconds": (now - finished).total_seconds() if finished else None,
        "overdue_seconds": fresh["overdue_seconds"] if fresh else None,
        "freshness": fresh,
        "paused": paused,
        "strip": [cell.as_json() for cell in cells],
        "stats": {
            "window_hours": STATS_WINDOW.total_seconds() / 3600,
            "runs": stats["runs"] if stats else 0,
            "succeeded": stats["succeeded"] if stats else 0,
            "failed": stats["failed"] if stats else 0,
            "success_rate": stats["succeeded"] / counted if stats and counted else None,
            "p50_seconds": stats["p50_seconds"] if stats else None,
            "p95_seconds": stats["p95_seconds"] if stats else None,
        },
    }


def entry_history(
    app: Any,
    statements: Statements,
    name: str,
    *,
    since: datetime,
    until: datetime,
    page: int = 0,
) -> Row:
    """One entry over ``[since, until)``: every row (the timeline's bars, newest first, at
    most ``TIMELINE_LIMIT``), a page of them for the table, the skips and waiting slots,
    its pause and its audit rows."""
    entries = Schedule(app)
    entry = entries.entry(name)
    lock = entries.lock_name(entry)
    window = {"lock_name": lock, "entry": name, "since": since, "until": until}
    runs = statements.rows("web_entry_runs", {**window, "limit": TIMELINE_LIMIT, "offset": 0})
    table = statements.rows("web_entry_runs", {**window, "limit": PAGE + 1, "offset": page * PAGE})
    ns = namespace(app)
    view = controls.Target(statements.tables, ns, "")
    paused = [p for p in controls.pauses(statements, view) if p["entry"] == name]
    return {
        "entry": name,
        "task": entry.task,
        "lock_name": lock,
        "schedule": describe(entry.schedule),
        "since": since,
        "until": until,
        "runs": runs,
        "page": page,
        "rows": table[:PAGE],
        "more": len(table) > PAGE,
        "skips": statements.rows("web_entry_skips", {**window, "limit": SKIPS_LIMIT}),
        "waiting": statements.rows("web_entry_waiting", {"lock_name": lock}),
        "paused": paused[0] if paused else None,
        "audit": audit_trail(statements, ns, entry=name, lock_name=lock, limit=20),
    }


def audit_trail(
    statements: Statements,
    ns: str,
    *,
    entry: str | None = None,
    lock_name: str | None = None,
    limit: int = 100,
    offset: int = 0,
) -> list[Row]:
    """The namespace's audit rows, newest first (``entry``: its rows and its lock's)."""
    params = {"namespace": ns, "entry": entry, "lock_name": lock_name, "limit": limit}
    return statements.rows("web_audit", {**params, "offset": offset})
