"""Plain aligned text for people, JSON for scripts: how ``celery pglock`` prints.

Times are shown in UTC with a ``Z`` and an age (``4m12s ago``): an operator comparing
hosts in different zones should never have to convert.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from typing import Any

import click

from celery_pglock.ops import Row, jsonable

NONE = "-"


def echo_json(payload: Any) -> None:
    click.echo(json.dumps(jsonable(payload), indent=2, sort_keys=False))


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """Columns padded to their widest cell; ``None`` shows as ``-``."""
    cells = [[NONE if value is None else str(value) for value in row] for row in rows]
    widths = [len(header) for header in headers]
    for row in cells:
        widths = [max(width, len(cell)) for width, cell in zip(widths, row, strict=True)]
    lines = [headers, *cells]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def section(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = table(headers, rows) if rows else "  (none)"
    return f"{title}\n{body}"


def when(moment: datetime | None, now: datetime | None = None) -> str | None:
    """``2026-11-29 03:00:01Z (4m12s ago)``."""
    if moment is None:
        return None
    now = now or datetime.now(timezone.utc)
    stamp = moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")
    return f"{stamp} ({duration((now - moment).total_seconds())} ago)"


def duration(seconds: float | None) -> str | None:
    """``0.42s``, ``3m04s``, ``2h05m``, ``3d04h``."""
    if seconds is None:
        return None
    if seconds < 60:
        return f"{max(seconds, 0.0):.2f}s" if seconds < 10 else f"{seconds:.0f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s"


def _who(session: Row | None) -> tuple[Any, Any, Any]:
    if session is None:
        return None, None, None
    return session.get("host"), session.get("pid"), session.get("task_id")


def locks_text(locks: list[Row]) -> str:
    headers = ("LOCK", "HELD", "KEY", "SCOPE", "HOST", "PID", "TASK ID", "SLOT", "TOKEN", "SINCE")
    rows = []
    for lock in locks:
        holder = lock["holder"] or {}
        limit = lock.get("concurrency", 1)
        rows.append(
            (
                lock["lock"] or "(unknown name)",
                _held(lock.get("held", 1), limit),
                lock["key"],
                _scope(holder),
                *_who(lock["holder"]),
                holder.get("slot"),
                holder.get("token"),
                when(holder.get("since")),
            )
        )
    text = section(f"HELD LOCKS ({len(rows)})", headers, rows)
    waiting = [(lock["lock"], waiter) for lock in locks for waiter in lock["waiters"]]
    if waiting:
        text += "\n\n" + waiters_text(waiting)
    return text


def _scope(holder: Row) -> str | None:
    """``SCOPE``: a lock held on rows (behind a transaction pooler) says so."""
    scope = holder.get("scope")
    return f"{scope} (rows)" if holder.get("lock_backend") == "rows" else scope


def _backend(session: Row) -> Any:
    """``BACKEND``: the server process of the holder's session; a lock on rows has none."""
    return "(on rows)" if session.get("lock_backend") == "rows" else session["backend_pid"]


def _held(held: int, limit: int | None) -> str | None:
    """``HELD``: how many of a lock name's N keys are held; "slot" for a slot's own lock."""
    if limit == 0:
        return "slot"
    return f"{held} of {limit}" if limit and limit > 1 else None


def waiters_text(waiting: list[tuple[str, Row]]) -> str:
    headers = ("LOCK", "BACKEND", "APPLICATION", "WAITING SINCE")
    rows = [
        (name, w["backend_pid"], w["application_name"], when(w.get("waiting_since")))
        for name, w in waiting
    ]
    return section(f"WAITERS ({len(rows)})", headers, rows)


def waiting_text(waiting: list[Row]) -> str:
    """The slots that wait their turn (``buffer_one``), oldest first."""
    headers = ("LOCK", "SLOT", "TASK", "TASK ID", "WAITING SINCE", "SENT", "LOCK IS")
    rows = [
        (
            row["lock_name"],
            row["slot"],
            row["task_name"],
            row["task_id"],
            when(row["waiting_since"]),
            when(row["sent_at"]) or "not yet",
            "held" if row["lock_held"] else "free (sent at the next sweep)",
        )
        for row in waiting
    ]
    return section(f"WAITING SLOTS ({len(rows)})", headers, rows)


def beat_text(beat: Row) -> str:
    headers = ("ROLE", "HOST", "PID", "BACKEND", "SINCE", "APPLICATION")
    rows: list[Sequence[Any]] = []
    sessions = [("leader", beat["leader"])] if beat["leader"] else []
    sessions += [("standby", standby) for standby in beat["standbys"]]
    for role, session in sessions:
        pids = (session["pid"], _backend(session))
        since = when(session.get("since") or session.get("waiting_since"))  # elected / waiting
        rows.append((role, session["host"], *pids, since, session["application_name"]))
    title = f"BEAT ({beat['lock']}): " + ("leader elected" if beat["leader"] else "no leader")
    return section(title, headers, rows)


def running_text(running: list[Row]) -> str:
    headers = ("LOCK", "SLOT", "TASK", "ATTEMPT", "TOKEN", "HOST", "PID", "STARTED", "HOLDER")
    rows = [
        (
            run["lock_name"],
            run["slot"],
            run["task_name"],
            run["attempts"],
            run["token"],
            run["host"],
            run["pid"],
            when(run["started_at"]),
            "alive" if run["holder_alive"] else "GONE (recorded failed at the next sweep)",
        )
        for run in running
    ]
    return section(f"RUNNING ({len(rows)})", headers, rows)


def tasks_text(tasks: list[Row]) -> str:
    """Which registered tasks are locked: a task that is not runs every duplicate."""
    headers = ("TASK", "LOCKED", "LOCK", "LOCKS", "SCOPE", "SCHEDULED ONLY")
    rows = [
        (
            task["task"],
            "yes" if task["locked"] else "NO",
            task.get("lock") or task.get("error"),
            task.get("locks"),
            task.get("scope"),
            _yes_no(task.get("scheduled_only")),
        )
        for task in tasks
    ]
    locked = sum(1 for task in tasks if task["locked"])
    return section(f"TASKS ({locked} of {len(tasks)} locked)", headers, rows)


def _yes_no(value: bool | None) -> str | None:
    return None if value is None else "yes" if value else "no"


def skips_text(skips: list[Row]) -> str:
    headers = ("AT", "LOCK", "SLOT", "REASON", "TASK ID", "HOST", "HOLDER TASK ID")
    return section(f"RECENT SKIPS ({len(skips)})", headers, [_skip_row(s) for s in skips])


def _skip_row(skip: Row) -> tuple[Any, ...]:
    who = (skip["task_id"], skip["host"], skip["holder_task_id"])
    return (when(skip["at"]), skip["lock_name"], skip["slot"], skip["reason"], *who)


def runs_text(runs: list[Row]) -> str:
    headers = (
        "LOCK",
        "SLOT",
        "STATE",
        "ATTEMPTS",
        "TOKEN",
        "HOST",
        "STARTED",
        "DURATION",
        "SKIPS",
        "REASON",
    )
    rows = [
        (
            run["lock_name"],
            run["slot"],
            run["state"],
            run["attempts"],
            run["token"],
            run["host"],
            when(run["started_at"] or run["scheduled_at"]),
            duration(run["duration_seconds"]),
            _skips(run),
            run["reason"],
        )
        for run in runs
    ]
    return table(headers, rows)


def _skips(run: Row) -> str:
    reasons = run.get("skip_reasons") or {}
    if not run["skips"]:
        return "0"
    detail = ", ".join(f"{reason} {count}" for reason, count in sorted(reasons.items()))
    return f"{run['skips']} ({detail})"


def holders_text(name: str, holders: list[Row]) -> str:
    headers = ("BACKEND", "HOST", "PID", "TASK ID", "SCOPE", "SINCE", "APPLICATION")
    rows = [
        (
            _backend(h),
            h["host"],
            h["pid"],
            h["task_id"],
            _scope(h),
            when(h["since"]),
            h["application_name"],
        )
        for h in holders
    ]
    return section(f"HOLDER OF {name}", headers, rows)


def shared_note(holders: list[Row]) -> str:
    """What else ending the holders' sessions frees: a threads, gevent or eventlet
    worker's runs share one session for their locks (``pglock_shared_sessions``)."""
    lines = [
        f"\nbackend {h['backend_pid']} also holds {h['other_locks']} other advisory locks "
        "(a session shared by one worker process's runs): ending it frees them too, and "
        "their runs report lock_lost\n"
        for h in holders
        if h.get("other_locks")
    ]
    return "".join(lines)


def pauses_text(pauses: list[Row]) -> str:
    headers = ("ENTRY", "PAUSED BY", "SINCE", "SLOTS HELD BACK", "REASON")
    rows = [
        (p["entry"], p["paused_by"], when(p["paused_at"]), p["slots_held_back"], p["reason"])
        for p in pauses
    ]
    return section(f"PAUSED ENTRIES ({len(pauses)})", headers, rows)


def shadowed_text(names: list[str]) -> str:
    """Entries both ``beat_schedule`` and PostgreSQL define: beat sends the code's."""
    lines = [f"SHADOWED ENTRIES ({len(names)}): stored in PostgreSQL and in beat_schedule"]
    lines += [f"  {name}" for name in names]
    lines.append("  beat sends the beat_schedule one: rename or remove the stored one")
    return "\n".join(lines)


def why_text(found: Row) -> str:
    """``pglock why``: the slot's row, then beat's claims, skips, holder and audit trail."""
    run = found["run"]
    title = f"{found['lock_name']} slot {found['slot']}"
    if found["entry"]:
        title += f" (beat entry {found['entry']})"
    lines = [title]
    if found.get("due"):
        lines.append(f"  due: {found['due']}")
    lines.append(f"  state: {_run_summary(run)}")
    if run and run["reason"]:
        lines.append(f"  reason: {run['reason']}")
    parts = ["\n".join(lines)]
    sends = [
        (
            s["entry"],
            s["sent_by"],
            when(s["claimed_at"]),
            when(s["sent_at"]),
            s["sends"],
            "paused" if s["paused"] else None,
        )
        for s in found["sends"]
    ]
    parts.append(
        section("BEAT", ("ENTRY", "CLAIMED BY", "CLAIMED", "SENT", "SENDS", "NOTE"), sends)
    )
    skips = [
        (when(s["at"]), s["reason"], s["task_id"], s["host"], s["pid"], s["holder_task_id"])
        for s in found["skips"]
    ]
    parts.append(section("SKIPS", ("AT", "REASON", "TASK ID", "HOST", "PID", "HOLDER"), skips))
    holder = found["holder"]
    held = "free" if holder is None else f"held by {holder['host']} pid {holder['pid']}"
    parts.append(f"LOCK NOW: {held}")
    audit = [
        (when(a["at"]), a["action"], a["actor"], a["reason"], json.dumps(a["detail"]) or None)
        for a in found["audit"]
    ]
    parts.append(section("AUDIT", ("AT", "ACTION", "BY", "REASON", "DETAIL"), audit))
    return "\n\n".join(parts)


def _run_summary(run: Row | None) -> str:
    if run is None:
        return "no ledger row: never claimed (not due, not sent, or pruned)"
    where = f" on {run['host']} pid {run['pid']}" if run["host"] else ""
    took = None
    if run["started_at"] and run["finished_at"]:
        took = duration((run["finished_at"] - run["started_at"]).total_seconds())
    timing = f", started {when(run['started_at'])}" if run["started_at"] else ""
    timing += f", took {took}" if took else ""
    token = f", token {run['token']}" if run["token"] is not None else ""
    attempts = f", {run['attempts']} attempt(s)" if run["attempts"] else ""
    task = f", task {run['task_id']}" if run["task_id"] else ""
    return f"{run['state']}{attempts}{token}{task}{where}{timing}"


def freshness_text(found: list[Any]) -> str:
    headers = ("ENTRY", "OVERDUE BY", "NOT SUCCEEDED SINCE", "LAST SUCCESS", "LAST DUE")
    rows = [
        (
            f.entry,
            duration(f.overdue_by) if f.overdue_by is not None else "no",
            f.first_pending,
            when(f.last_success_at),
            f.last_due,
        )
        for f in found
    ]
    late = sum(1 for f in found if f.overdue_by is not None)
    return section(f"FRESHNESS ({late} overdue of {len(found)} watched)", headers, rows)


def rogue_text(rogue: list[Row]) -> str:
    headers = ("TASK", "SENDER", "FIRST SEEN", "LAST SEEN", "HOURS REPORTED")
    rows = [
        (r["task_name"], r["origin"], when(r["first_at"]), when(r["last_at"]), r["reports"])
        for r in rogue
    ]
    title = "SLOT-LESS MESSAGES OF SCHEDULED TASKS: a stock `celery beat` still running?"
    return section(f"{title} ({len(rogue)})", headers, rows)
