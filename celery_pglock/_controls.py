"""Operator controls on the ledger: pause and resume a beat entry, trigger a run, and the
one answer to "what happened to this slot" (``why``).

State lives in PostgreSQL, so every beat replica obeys at its next tick. Each control
writes an audit row (who, when, why) in the same transaction as its change. These are
the functions behind ``celery -A proj pglock pause|resume|trigger|why`` (through
``steering.actions``, which audits as who asks); each takes the store's ``Statements``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_pglock._keys import lock_key
from celery_pglock.ops import Row, jsonable, locks, require_tables
from celery_pglock.schema import Tables
from celery_pglock.store.statements import Statements

MANUAL_PREFIX = "manual:"


@dataclass(frozen=True)
class Target:
    """Where a control acts: the app's namespace and tables, and who acts."""

    tables: Tables
    namespace: str
    actor: str


def audit(
    statements: Statements, target: Target, action: str, reason: str | None = None, **what: Any
) -> Row:
    """One audit row: ``what`` may name the entry, lock_name and slot; the rest is detail."""
    named = {key: what.pop(key, None) for key in ("entry", "lock_name", "slot")}
    params = {
        **named,
        "namespace": target.namespace,
        "action": action,
        "actor": target.actor,
        "reason": reason,
        "detail": jsonable(what),
    }
    [row] = statements.rows("control_audit", params)
    return row


def pauses(statements: Statements, target: Target) -> list[Row]:
    """The paused entries of the namespace: who paused each, when, why, slots held back."""
    require_tables(statements)
    return statements.rows("control_pauses", {"namespace": target.namespace})


def pause(statements: Statements, target: Target, entry: str, reason: str | None) -> Row:
    """Pause ``entry``; returns the pause in force (``new`` false when it already was)."""
    require_tables(statements)
    params = {"namespace": target.namespace, "entry": entry, "actor": target.actor}
    with statements.transaction():
        made = statements.rows("control_pause", {**params, "reason": reason})
        if made:
            audit(statements, target, "pause", reason, entry=entry)
    if made:
        return {**made[0], "new": True}
    [current] = [row for row in pauses(statements, target) if row["entry"] == entry]
    return {**current, "new": False}


def resume(statements: Statements, target: Target, entry: str, *, catch_up: int) -> Row | None:
    """Resume ``entry`` (None: it was not paused). With ``catch_up`` > 0, ``caught_up``
    lists the newest that many slots held back by the pause, oldest first: recorded as
    sent by ``target.actor``, for the caller to send now."""
    require_tables(statements)
    params = {"namespace": target.namespace, "entry": entry}
    with statements.transaction():
        ended = statements.rows("control_resume", params)
        if not ended:
            return None
        sent: list[str] = []
        if catch_up > 0:
            more = {"paused_at": ended[0]["paused_at"], "limit": catch_up}
            rows = statements.rows("control_catch_up", {**params, **more, "actor": target.actor})
            sent = [row["slot"] for row in rows]
        audit(statements, target, "resume", entry=entry, caught_up=sent)
    return {**ended[0], "caught_up": sent}


def manual_slot(now: datetime | None = None) -> str:
    """``manual:<UTC time>``, the slot of a run triggered by hand."""
    moment = (now or datetime.now(timezone.utc)).astimezone(timezone.utc)
    return MANUAL_PREFIX + moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_trigger(
    statements: Statements, target: Target, *, entry: str, task: str, lock_name: str, slot: str
) -> Row:
    """Write the manual slot's row ``scheduled`` (unless it has one) and audit it.

    Returns ``send``: false when the slot already succeeded (nothing is to be sent), with
    the row's state and token."""
    require_tables(statements)
    params = {
        "lock_name": lock_name,
        "slot": slot,
        "key": lock_key(lock_name),
        "entry": entry,
        "actor": target.actor,
        "task_name": task,
    }
    with statements.transaction():
        [row] = statements.rows("control_trigger", params)
        send = row["state"] != "succeeded"
        audit(statements, target, "trigger", entry=entry, lock_name=lock_name, slot=slot, sent=send)
    return {**row, "send": send}


def run_row(statements: Statements, lock_name: str, slot: str) -> Row | None:
    """The ledger row of (lock name, slot), if any."""
    return statements.row("why_run", {"lock_name": lock_name, "slot": slot})


def skips_of(statements: Statements, lock_name: str, slot: str) -> list[Row]:
    """Every skip of (lock name, slot), oldest first."""
    return statements.rows("why_skips", {"lock_name": lock_name, "slot": slot})


def lock_has_rows(statements: Statements, lock_name: str) -> bool:
    """Whether ``lock_name`` ever had a ledger row or a skip (any slot)."""
    [row] = statements.rows("control_lock_rows", {"lock_name": lock_name})
    return bool(row["known"])


def why(
    statements: Statements, target: Target, *, lock_name: str, slot: str, entry: str | None
) -> Row:
    """Everything known about one slot: its row, beat's claims and sends, every skip, the
    lock's holder now, the audit trail (the entry's pauses included)."""
    require_tables(statements)
    params = {"namespace": target.namespace, "lock_name": lock_name, "slot": slot, "entry": entry}
    run = run_row(statements, lock_name, slot)
    key = lock_key(lock_name)
    held = [found for found in locks(statements, [lock_name]) if found["key"] == key]
    return {
        "lock_name": lock_name,
        "slot": slot,
        "entry": entry or (run["entry"] if run else None),
        "run": run,
        "sends": statements.rows("why_sends", params),
        "skips": skips_of(statements, lock_name, slot),
        "holder": held[0]["holder"] if held else None,
        "audit": statements.rows("why_audit", params),
    }


def slot_rows(statements: Statements, lock_name: str, slots: list[str]) -> dict[str, Row]:
    """The ledger rows of these slots of ``lock_name``, by slot (absent: no row)."""
    params = {"lock_name": lock_name, "slots": slots}
    return {row["slot"]: row for row in statements.rows("control_slot_rows", params)}


def reopen(
    statements: Statements, target: Target, *, lock_name: str, slot: str, reason: str
) -> Row | None:
    """Open a succeeded slot again for one more run, on purpose; audit who, why and the
    outcome it had. None (nothing changed) when the slot has not succeeded."""
    require_tables(statements)
    params = {"lock_name": lock_name, "slot": slot}
    why = f"rerun by {target.actor}: {reason}"
    with statements.transaction():
        before = statements.rows("control_reopen", {**params, "reason": why})
        if not before:
            return None
        audit(
            statements, target, "rerun", reason, lock_name=lock_name, slot=slot, previous=before[0]
        )
    return before[0]
