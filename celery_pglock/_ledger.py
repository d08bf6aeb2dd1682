"""The run ledger: one durable row per (lock name, slot), and the log of skipped messages.

The claim itself happens in the same statement as the advisory lock (see ``locks``); this
module records outcomes and skips and turns rows into the meta a skipped task reports
(the ``Claim`` and ``Skip`` it is given and gives are in ``protocol``).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

from celery_pglock._config import Settings
from celery_pglock._protocol import Claim, Skip
from celery_pglock.errors import DatabaseUnavailable, WaitEnded
from celery_pglock.store._database import Database
from celery_pglock.store._lock_sessions import LockSession
from celery_pglock.store.statements import opened

logger = logging.getLogger("celery_pglock")

T = TypeVar("T")

MAX_REASON_LENGTH = 500
# Why a `running` row became `failed` without its attempt saying so (``sweep_orphans``,
# or the skip of a redelivery that found it). record_outcome recognises the prefix.
ABANDONED = (
    "abandoned: the attempt's session ended without recording an outcome (its worker "
    "process died) and no later attempt took the slot over"
)
# How long a finished attempt whose lock connection broke keeps trying to record its
# outcome: through a restart or a failover (a promotion takes seconds, a managed
# database's failover up to a minute). Given up after that, the beat leader's sweep
# records the row failed (abandoned), and a later write of the outcome still wins.
OUTCOME_RETRY_SECONDS = 60.0
OUTCOME_RETRY_PAUSES = (0.1, 0.25, 0.5, 1.0, 2.0)  # then 2 s each
ORPHAN_SWEEP_LIMIT = 100  # rows per sweep: bounds the time a sweep takes from beat

SUCCEEDED = "succeeded"
FAILED = "failed"


def short_reason(text: str) -> str:
    return text if len(text) <= MAX_REASON_LENGTH else text[: MAX_REASON_LENGTH - 1] + "…"


def record_skip(
    session: LockSession,
    claim: Claim,
    reason: str,
    *,
    held: bool,
    newer_slot: str | None = None,
    local_holder: str | None = None,
    outage: bool = False,
) -> Skip:
    """Append the skip to the log and explain it. ``held``: this attempt got the lock (the
    slot turned out done, superseded or late), which the statement frees; ``newer_slot``
    the succeeded slot that supersedes this one, if any; ``local_holder`` the task id of a
    run of this process holding the lock on a shared session (``shared``); ``outage``:
    any failure of the statement is taken for an outage (retried), see ``LockSession.row``."""
    params = {
        **claim.params(),
        "held": held,
        "reason": reason,
        "newer_slot": newer_slot,
        "local_holder": local_holder,
        "abandoned_reason": ABANDONED,
    }
    row = session.row("skip", params, outage=outage)
    assert row is not None  # the statement always returns one row
    if row["abandoned_token"] is not None:
        report_abandoned([{**row, "lock_name": claim.lock_name, "slot": claim.slot}])
    return skip_from_row(claim, row)


ORPHAN_SWEEP_PARAMS = {"limit": ORPHAN_SWEEP_LIMIT, "reason": ABANDONED}
# Runs one named statement with its parameters, on a session the caller chose (the beat
# leader's own, in leader mode); its rows, as dicts by column name.
RunQuery = Callable[[str, dict[str, Any]], list[dict[str, Any]]]


def sweep_orphans(run_query: RunQuery) -> list[dict[str, Any]]:
    """Record ``failed`` (abandoned) the oldest ``running`` rows whose attempt's session is
    gone; returns them, logged. The beat leader runs it every few seconds."""
    found = run_query("abandon_orphans", ORPHAN_SWEEP_PARAMS)
    report_abandoned(found)
    return found


def report_abandoned(rows: list[dict[str, Any]]) -> None:
    for row in rows:
        token = row.get("abandoned_token", row.get("token"))
        logger.warning(
            "lock %r slot %s: attempt (token %s) recorded failed, its session is gone: %s",
            row["lock_name"],
            row["slot"],
            token,
            ABANDONED,
            extra={
                "action": "pglock_run_abandoned",
                "lock": row["lock_name"],
                "slot": row["slot"],
                "token": token,
            },
        )


def skip_from_row(claim: Claim, row: dict[str, Any]) -> Skip:
    reason = row["reason"]
    holder: dict[str, Any] | None
    if reason == "done":
        holder = _who_ran(row, "run")
        token = row["run_token"]
    elif reason == "superseded" and row.get("newer_slot") is not None:
        holder = {**_who_ran(row, "newer"), "slot": row["newer_slot"]}
        token = row["newer_token"]
    else:
        holder = _live_holder(row)
        token = row["holder_token"]
    return Skip(
        reason=reason, lock_name=claim.lock_name, slot=claim.slot, holder=holder, token=token
    )


def enqueued_skip(db: Database, claim: Claim) -> Skip | None:
    """Before publishing: the skip of a slot that already succeeded or that a live session
    is running (logged as such), else None. One plain look-up on a pooled connection."""
    with db.statements() as statements:
        row = statements.row("enqueue_check", claim.params())
    return None if row is None else skip_from_row(claim, row)


def _iso(moment: datetime | None) -> str | None:
    return moment.isoformat() if moment is not None else None


def _who_ran(row: dict[str, Any], run: str) -> dict[str, Any]:
    return {
        "host": row[f"{run}_host"],
        "pid": row[f"{run}_pid"],
        "task_id": row[f"{run}_task_id"],
        "since": None,
        "finished": _iso(row[f"{run}_finished_at"]),
    }


def _live_holder(row: dict[str, Any]) -> dict[str, Any] | None:
    if row["backend_pid"] is None and row["holder_since"] is None:
        return None  # the holder finished between our try and this look-up
    # (a holder on rows has no backend: its row says who it is)
    if row["holder_task_id"] is not None or row["holder_host"] is not None:
        return {
            "host": row["holder_host"],
            "pid": row["holder_pid"],
            "task_id": row["holder_task_id"],
            "since": _iso(row["holder_since"]),
            "slot": row["holder_slot"],
        }
    # A transaction-scope holder: its rows are not committed, its application_name says who.
    return {**parse_application_name(row["application_name"]), "since": _iso(row["xact_start"])}


def holder_application_name(task_id: str | None, pid: int, host: str) -> str:
    """``pglock <pid> <task id> <host>``, cut to PostgreSQL's 63 bytes."""
    name = f"pglock {pid} {task_id or '-'} {host}"
    return name.encode()[:63].decode("utf-8", "ignore")


def parse_application_name(name: str | None) -> dict[str, Any]:
    parts = (name or "").split(" ", 3)
    if len(parts) < 3 or parts[0] != "pglock":
        return {"host": None, "pid": None, "task_id": None}
    host = parts[3] if len(parts) > 3 else None
    task_id = None if parts[2] == "-" else parts[2]
    return {"host": host, "pid": int(parts[1]) if parts[1].isdigit() else None, "task_id": task_id}


def record_outcome(db: Database, claim: Claim, token: int, state: str, reason: str | None) -> bool:
    """Record an attempt's outcome on a fresh connection (its own one broke).

    Only succeeds if no later attempt took the row over; returns whether it did. The
    connection is a new one, not pooled: whatever broke ours (a server restart) broke the
    idle pooled ones too.
    """
    if claim.slot is None:
        return False
    params = {**claim.params(), "token": token, "state": state, "reason": reason}
    with db.lock_sessions.fresh() as session:
        return session.row("record_outcome", params) is not None


def record_outcome_when_reachable(
    db: Database, claim: Claim, token: int, state: str, reason: str | None
) -> bool:
    """``record_outcome``, tried again while PostgreSQL is unreachable or read-only (a
    replica not promoted yet), for up to ``OUTCOME_RETRY_SECONDS``."""
    return when_reachable(claim, lambda: record_outcome(db, claim, token, state, reason))


def when_reachable(claim: Claim, record: Callable[[], T]) -> T:
    """``record()`` (the outcome of ``claim``'s attempt, written on a fresh connection),
    tried again while PostgreSQL is unreachable or read-only, for up to
    ``OUTCOME_RETRY_SECONDS``."""
    deadline = time.monotonic() + OUTCOME_RETRY_SECONDS
    for attempt in itertools.count():
        try:
            return record()
        # An outage, the session ended, a replica not promoted yet, a statement cut short.
        except (DatabaseUnavailable, WaitEnded):
            pause = OUTCOME_RETRY_PAUSES[min(attempt, len(OUTCOME_RETRY_PAUSES) - 1)]
            if time.monotonic() + pause > deadline:
                raise
            if attempt == 0:
                logger.warning(
                    "the outcome of %r for slot %r waits for PostgreSQL (up to %d s)",
                    claim.lock_name,
                    claim.slot,
                    OUTCOME_RETRY_SECONDS,
                    extra={"action": "pglock_outcome_retrying", "lock": claim.lock_name},
                )
            time.sleep(pause)
    raise AssertionError("unreachable")  # pragma: no cover - count() never ends


def record_worker_lost(settings: Settings, claim: Claim, reason: str) -> int | None:
    """Record the ``running`` attempt of ``claim``'s message failed (its process died).

    On a fresh, unpooled connection (the worker's main process has no pool). Returns the
    attempt's token, or None when no such row is still ``running`` (no slot, transaction
    scope, or a later attempt took the slot over).
    """
    if claim.slot is None:
        return None
    params = {**claim.params(), "reason": short_reason(reason)}
    with opened(settings) as statements:
        row = statements.row("record_worker_lost", params)
    return None if row is None else int(row["token"])


def record_failure_after_rollback(
    session: LockSession, claim: Claim, token: int, reason: str
) -> None:
    """Transaction scope: the claim rolled back with the body; keep the failed attempt."""
    if claim.slot is None:
        return
    params = {**claim.params(), "token": token, "reason": short_reason(reason)}
    session.row("record_failure_after_rollback", params)
    session.commit()
