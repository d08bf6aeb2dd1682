"""The in-memory twin of the store's ``Statements``: the operator's (pauses, triggers,
reruns, catch-ups, the audit and ``why``) and beat's claims (claim, confirm, take over
the unconfirmed, the last slots sent), without a server, for unit tests that run in
milliseconds.

It keeps the library's tables that these statements read and write (runs, beat sends,
beat's state, skips, pauses, audit) as dicts and answers each statement by name as
PostgreSQL does: the same rows, the same NULL rules, a statement that sees the table as
it was before its own insert (``control_trigger``), ``now()`` read once per transaction
from a clock the test controls (each transaction's later than the one before, as on a
server). The contract tests (``tests/contract``) run the same assertions on this twin
and on real PostgreSQL, so the two cannot drift apart. A statement it has no twin of
raises ``NotImplementedError`` naming it: a test never silently passes on a guess.

Seed the tables with ``add_run``, ``add_send`` and ``add_skip``; read them back as a test
would, through the statements, or directly (``data``: the rows of each table).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from celery_pglock._keys import lock_key
from celery_pglock.schema import Tables, latest_version
from celery_pglock.store.statements import Params, Row

Clock = Callable[[], datetime]

RUN_COLUMNS = [
    "lock_name",
    "slot",
    "state",
    "attempts",
    "token",
    "task_id",
    "task_name",
    "host",
    "pid",
    "entry",
    "sent_by",
    "reason",
    "created_at",
    "scheduled_at",
    "started_at",
    "finished_at",
    "updated_at",
]
SEND_COLUMNS = ["entry", "slot", "sent_by", "sends", "claimed_at", "sent_at", "paused"]
SKIP_COLUMNS = ["at", "reason", "task_id", "task_name", "host", "pid", "holder_task_id"]
AUDIT_COLUMNS = ["at", "action", "entry", "lock_name", "slot", "actor", "reason", "detail"]
PAUSE_COLUMNS = ["entry", "paused_by", "reason", "paused_at"]


def _utc_now() -> datetime:
    return datetime.now(timezone.utc)


def _pick(row: Row, columns: list[str]) -> Row:
    return {column: row.get(column) for column in columns}


def _equal(left: Any, right: Any) -> bool:
    """SQL's ``=``: NULL equals nothing, itself included."""
    return left is not None and right is not None and left == right


@dataclass
class Rows:
    """The rows of the library's tables that the twins' statements touch."""

    runs: dict[tuple[str, str], Row] = field(default_factory=dict)
    sends: dict[tuple[str, str, str], Row] = field(default_factory=dict)
    beat: dict[tuple[str, str], Row] = field(default_factory=dict)
    skips: list[Row] = field(default_factory=list)
    pauses: dict[tuple[str, str], Row] = field(default_factory=dict)
    # Stored entries switched off (schedules), by (namespace, entry): who switched them.
    disabled: dict[tuple[str, str], str] = field(default_factory=dict)
    audit: list[Row] = field(default_factory=list)
    holders: dict[int, Row] = field(default_factory=dict)  # by lock key (``grant_lock``)
    waiting: dict[str, Row] = field(default_factory=dict)  # by lock name (``buffer_one``)


class InMemoryStatements:
    """``Statements`` kept in memory; ``clock`` is ``now()`` (default: the wall clock)."""

    def __init__(self, tables: Tables | None = None, *, clock: Clock = _utc_now) -> None:
        self.tables = tables or Tables("pglock")
        self.clock = clock
        self.data = Rows()
        self._now: datetime | None = None  # fixed inside a transaction, as now() is
        self._last = datetime.min.replace(tzinfo=timezone.utc)
        self._handlers: dict[str, Callable[[Params], list[Row]]] = {
            "control_audit": self._audit,
            "control_pause": self._pause,
            "control_pauses": self._pauses,
            "control_resume": self._resume,
            "control_catch_up": self._catch_up,
            "control_trigger": self._trigger,
            "control_lock_rows": self._lock_rows,
            "control_slot_rows": self._slot_rows,
            "control_reopen": self._reopen,
            "why_run": self._why_run,
            "why_sends": self._why_sends,
            "why_skips": self._why_skips,
            "why_audit": self._why_audit,
            "web_audit": self._web_audit,
            # Memory has no server sessions: no advisory lock is held or waited for.
            "ops_locks": lambda _: [],
            "beat_claim": self._beat_claim,
            "beat_confirm": self._beat_confirm,
            "beat_unsent": self._beat_unsent,
            "beat_state": self._beat_state,
        }

    def __repr__(self) -> str:
        return f"<InMemoryStatements {self.tables.schema}.{self.tables.prefix}*>"

    # -- Statements ----------------------------------------------------------------------

    def rows(self, name: str, params: Params | None = None) -> list[Row]:
        handler = self._handlers.get(name)
        if handler is None:
            raise NotImplementedError(f"the in-memory store has no twin of statement {name!r}")
        with self.transaction():  # one statement is one transaction outside of one
            return handler(stored(params))

    def row(self, name: str, params: Params | None = None) -> Row | None:
        found = self.rows(name, params)
        return found[0] if found else None

    def run(self, name: str, params: Params | None = None) -> int:
        return len(self.rows(name, params))

    @contextmanager
    def transaction(self) -> Iterator[None]:
        if self._now is not None:  # nested: part of the outer transaction
            yield
            return
        saved = copy.deepcopy(self.data)
        self._now = self._tick()
        try:
            yield
        except BaseException:
            self.data = saved
            raise
        finally:
            self._now = None

    def schema_version(self) -> int | None:
        return latest_version()

    # -- a session's transaction (``memory_sessions``) ------------------------------------

    def begin(self) -> Rows:
        """A session's transaction begins: ``now`` stays fixed until ``end``. Returns the
        tables as they are, which ``end`` puts back on a rollback."""
        self._now = self._tick()
        return copy.deepcopy(self.data)

    def end(self, restore: Rows | None = None) -> None:
        """A session's transaction ends: committed, or rolled back to ``restore``."""
        if restore is not None:
            self.data = restore
        self._now = None

    # -- seeding -------------------------------------------------------------------------

    def add_run(self, lock_name: str, slot: str, state: str, **columns: Any) -> Row:
        """A ledger row, as the worker's statements leave it (``columns``: the rest)."""
        row: Row = dict.fromkeys(RUN_COLUMNS) | {"attempts": 0, "created_at": self.now}
        row |= {"lock_name": lock_name, "slot": slot, "state": state, "updated_at": self.now}
        row |= {"lock_key": lock_key(lock_name)} | columns
        self.data.runs[(lock_name, slot)] = row
        return row

    def add_send(self, namespace: str, entry: str, slot: str, **columns: Any) -> Row:
        """A beat claim of (entry, slot), sent unless ``paused`` (``columns``: the rest)."""
        row: Row = {"namespace": namespace, "entry": entry, "slot": slot, "lock_name": None}
        row |= {"sent_by": "beat", "sends": 1, "claimed_at": self.now, "sent_at": None}
        row |= {"paused": False} | columns
        self.data.sends[(namespace, entry, slot)] = row
        return row

    def add_disabled(self, namespace: str, entry: str, by: str) -> None:
        """A stored entry switched off (``schedules.update(..., enabled=False)``)."""
        self.data.disabled[(namespace, entry)] = by

    def add_skip(self, lock_name: str, slot: str | None, reason: str, **columns: Any) -> Row:
        """A skip of (lock name, slot) (``columns``: who skipped)."""
        row: Row = dict.fromkeys(SKIP_COLUMNS) | {"at": self.now}
        row |= {"lock_name": lock_name, "slot": slot, "reason": reason} | columns
        self.data.skips.append(row)
        return row

    # -- the statements' twins -----------------------------------------------------------

    @property
    def now(self) -> datetime:
        return self._now or self._tick()

    def _tick(self) -> datetime:
        """The clock's time, later than the last one read (as two transactions' now())."""
        self._last = max(self.clock(), self._last + timedelta(microseconds=1))
        return self._last

    def _audit(self, p: Params) -> list[Row]:
        row = {key: p[key] for key in ("namespace", "action", "entry", "lock_name", "slot")}
        row |= {"actor": p["actor"], "reason": p["reason"], "detail": p["detail"] or {}}
        row |= {"id": len(self.data.audit) + 1, "at": self.now}
        self.data.audit.append(row)
        return [{"id": row["id"], "at": row["at"]}]

    def _pause(self, p: Params) -> list[Row]:
        key = (p["namespace"], p["entry"])
        if key in self.data.pauses:
            return []
        row = {"namespace": p["namespace"], "entry": p["entry"], "paused_by": p["actor"]}
        self.data.pauses[key] = row | {"reason": p["reason"], "paused_at": self.now}
        return [_pick(self.data.pauses[key], PAUSE_COLUMNS)]

    def _held_back(self, namespace: str, entry: str, paused_at: datetime) -> list[Row]:
        """The claims of ``entry`` a pause since ``paused_at`` held back."""
        return [
            send
            for send in self.data.sends.values()
            if (send["namespace"], send["entry"]) == (namespace, entry)
            and send["paused"]
            and send["claimed_at"] >= paused_at
        ]

    def _pauses(self, p: Params) -> list[Row]:
        found = [row for row in self.data.pauses.values() if row["namespace"] == p["namespace"]]
        return [
            _pick(row, PAUSE_COLUMNS) | {"slots_held_back": len(self._held_back(*_pause_key(row)))}
            for row in sorted(found, key=lambda row: row["entry"])
        ]

    def _resume(self, p: Params) -> list[Row]:
        ended = self.data.pauses.pop((p["namespace"], p["entry"]), None)
        return [_pick(ended, PAUSE_COLUMNS)] if ended else []

    def _catch_up(self, p: Params) -> list[Row]:
        held = self._held_back(p["namespace"], p["entry"], p["paused_at"])
        newest = sorted(held, key=lambda send: send["slot"], reverse=True)[: p["limit"]]
        for send in newest:
            send.update(paused=False, sent_at=self.now, sent_by=p["actor"], sends=send["sends"] + 1)
            run = self.data.runs.get((send["lock_name"], send["slot"]))
            if run is not None and run["state"] == "paused":
                run.update(state="scheduled", reason=None, finished_at=None)
                run.update(sent_by=p["actor"], updated_at=self.now)
        return [{"slot": send["slot"]} for send in sorted(newest, key=lambda send: send["slot"])]

    def _trigger(self, p: Params) -> list[Row]:
        before = self.data.runs.get((p["lock_name"], p["slot"]))
        if before is None:
            made = {"entry": p["entry"], "sent_by": p["actor"], "task_name": p["task_name"]}
            self.add_run(p["lock_name"], p["slot"], "scheduled", **made, scheduled_at=self.now)
        seen = before or {}  # the statement sees the table as it was before its insert
        return [
            {
                "inserted": 0 if before else 1,
                "state": seen.get("state"),
                "token": seen.get("token"),
                "finished_at": seen.get("finished_at"),
            }
        ]

    def _lock_rows(self, p: Params) -> list[Row]:
        name = p["lock_name"]
        known = any(lock == name for lock, _ in self.data.runs)
        known = known or any(skip["lock_name"] == name for skip in self.data.skips)
        return [{"known": known}]

    def _slot_rows(self, p: Params) -> list[Row]:
        columns = ["slot", "state", "token", "reason", "finished_at"]
        found = (self.data.runs.get((p["lock_name"], slot)) for slot in p["slots"])
        return [_pick(row, columns) for row in found if row is not None]

    def _reopen(self, p: Params) -> list[Row]:
        row = self.data.runs.get((p["lock_name"], p["slot"]))
        if row is None or row["state"] != "succeeded":
            return []
        columns = ["state", "token", "task_id", "host", "pid", "started_at", "finished_at"]
        before = _pick(row, columns)
        row.update(state="failed", reason=p["reason"], updated_at=self.now)
        return [before]

    def _why_run(self, p: Params) -> list[Row]:
        row = self.data.runs.get((p["lock_name"], p["slot"]))
        return [_pick(row, RUN_COLUMNS)] if row else []

    def _why_sends(self, p: Params) -> list[Row]:
        found = [
            send
            for send in self.data.sends.values()
            if send["namespace"] == p["namespace"]
            and send["slot"] == p["slot"]
            and (_equal(send["lock_name"], p["lock_name"]) or _equal(send["entry"], p["entry"]))
        ]
        return [_pick(send, SEND_COLUMNS) for send in sorted(found, key=lambda s: s["claimed_at"])]

    def _why_skips(self, p: Params) -> list[Row]:
        found = [
            skip
            for skip in self.data.skips
            if _equal(skip["lock_name"], p["lock_name"]) and _equal(skip["slot"], p["slot"])
        ]
        return [_pick(skip, SKIP_COLUMNS) for skip in sorted(found, key=lambda s: s["at"])]

    def _why_audit(self, p: Params) -> list[Row]:
        def about(row: Row) -> bool:
            of_slot = _equal(row["lock_name"], p["lock_name"]) and _equal(row["slot"], p["slot"])
            return of_slot or (row["slot"] is None and _equal(row["entry"], p["entry"]))

        found = [row for row in self.data.audit if row["namespace"] == p["namespace"]]
        found = [row for row in found if about(row)]
        return [_pick(row, AUDIT_COLUMNS) for row in sorted(found, key=lambda r: r["at"])]

    def _web_audit(self, p: Params) -> list[Row]:
        """A namespace's trail, newest first; ``entry`` (NULL: any) narrows it."""

        def about(row: Row) -> bool:
            if p["entry"] is None:
                return True
            return _equal(row["entry"], p["entry"]) or _equal(row["lock_name"], p["lock_name"])

        found = [r for r in self.data.audit if r["namespace"] == p["namespace"] and about(r)]
        newest = sorted(found, key=lambda r: r["id"], reverse=True)
        return [_pick(r, ["id", *AUDIT_COLUMNS]) for r in newest][p["offset"] :][: p["limit"]]

    # -- beat's claims (beat_queries.sql) ------------------------------------------------

    def _beat_claim(self, p: Params) -> list[Row]:
        namespace, replica = p["namespace"], p["replica"]
        stored = p.get("stored") or [False] * len(p["entries"])
        wanted = zip(p["entries"], p["slots"], p["lock_names"], p["tasks"], stored, strict=True)
        claimed = []
        for entry, slot, lock_name, task_name, is_stored in wanted:
            if (namespace, entry, slot) in self.data.sends:
                continue  # ON CONFLICT DO NOTHING: another replica's claim, or a repeat
            reason = self._why_not_sent(namespace, entry, stored=is_stored)
            paused = reason is not None
            self.add_send(
                namespace, entry, slot, lock_name=lock_name, sent_by=replica, paused=paused
            )
            claimed.append({"entry": entry, "slot": slot, "paused": paused})
            if (lock_name, slot) in self.data.runs:
                continue
            made = {"entry": entry, "sent_by": replica, "task_name": task_name}
            run = self.add_run(lock_name, slot, "scheduled", **made, scheduled_at=self.now)
            if reason is not None:
                run.update(state="paused", reason=reason, finished_at=self.now)
        return claimed

    def _why_not_sent(self, namespace: str, entry: str, *, stored: bool) -> str | None:
        """Why a claimed slot is not sent: its entry paused, or (a stored one) disabled."""
        pause = self.data.pauses.get((namespace, entry))
        if pause is not None:
            return _pause_reason(pause)
        disabled_by = self.data.disabled.get((namespace, entry)) if stored else None
        return f"disabled by {disabled_by}" if disabled_by is not None else None

    def _beat_confirm(self, p: Params) -> list[Row]:
        namespace = p["namespace"]
        for entry, slot in zip(p["entries"], p["slots"], strict=True):
            send = self.data.sends.get((namespace, entry, slot))
            if send is not None:
                send["sent_at"] = self.now
        newest: dict[str, list[Any]] = {}
        for entry, slot, run_at in zip(p["entries"], p["slots"], p["run_ats"], strict=True):
            last = newest.setdefault(entry, [slot, run_at, 0])
            last[:] = [max(last[0], slot), max(last[1], run_at), last[2] + 1]
        for entry, (slot, run_at, count) in newest.items():
            state = self.data.beat.setdefault(
                (namespace, entry), {"entry": entry, "last_run_at": None, "total_run_count": 0}
            )
            if state["last_run_at"] is None or state["last_run_at"] <= run_at:
                state.update(last_slot=slot, last_run_at=run_at, updated_at=self.now)
                state["total_run_count"] += count
        return []

    def _beat_unsent(self, p: Params) -> list[Row]:
        after = self.now - timedelta(seconds=p["after"])
        horizon = self.now - timedelta(seconds=p["horizon"])
        found = [
            send
            for send in self.data.sends.values()
            if send["namespace"] == p["namespace"]
            and send["sent_at"] is None
            and not send["paused"]
            and horizon < send["claimed_at"] < after
        ]
        taken = sorted(found, key=lambda send: send["claimed_at"])[: p["limit"]]
        for send in taken:
            send.update(sent_by=p["replica"], claimed_at=self.now, sends=send["sends"] + 1)
        return [{"entry": send["entry"], "slot": send["slot"]} for send in taken]

    def _beat_state(self, p: Params) -> list[Row]:
        columns = ["entry", "last_slot", "last_run_at", "total_run_count"]
        found = self.data.beat.items()
        return [_pick(row, columns) for (namespace, _), row in found if namespace == p["namespace"]]


def _pause_key(pause: Row) -> tuple[str, str, datetime]:
    """What the claims a pause held back are found by."""
    return pause["namespace"], pause["entry"], pause["paused_at"]


def _pause_reason(pause: Row) -> str:
    """How a slot claimed while its entry is paused is recorded: who paused it, and why."""
    why = f": {pause['reason']}" if pause["reason"] is not None else ""
    return f"paused by {pause['paused_by']}{why}"


def stored(params: Params | None) -> dict[str, Any]:
    """``params`` as the server would keep them: a mapping goes through JSON (jsonb)."""
    return {
        key: json.loads(json.dumps(value)) if isinstance(value, Mapping) else value
        for key, value in (params or {}).items()
    }
