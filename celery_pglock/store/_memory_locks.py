"""The in-memory twin of the lock statements (``sql/queries.sql``: ``acquire``,
``acquire_mutex``, ``release``, ``release_unwaited``, ``unlock_shared``, ``skip``,
``record_outcome``, ``record_failure_after_rollback``) and of the advisory locks they take.

``AdvisoryLocks`` keeps which session holds which key as PostgreSQL does: a session's
lock is re-entrant (taken twice, freed twice), a transaction's lock ends with its
transaction, another session's try fails while one is held, and a session's end frees
all of them. A lock name's key is an int, a slot's own lock (``pglock_concurrency``) a
pair of ints, apart from every int key as on the server. ``LockStatements`` answers each
statement as its SQL does, on the tables of an ``InMemoryStatements`` (the ledger, the
skips, the holders), with fencing tokens from one sequence that never goes back, not
even on a rollback. The session a statement runs on is a ``Caller``; the server it
belongs to (``memory_sessions``) says which sessions live.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from celery_pglock._slots import parse_slot
from celery_pglock.store._memory import InMemoryStatements
from celery_pglock.store.statements import Params, Row

Key = int | tuple[int, int]  # a lock name's key, or a slot's own lock (two ints)


@dataclass
class Caller:
    """The session a statement runs on, as the statements see it."""

    pid: int
    settings: dict[str, str] = field(default_factory=dict)  # session-level GUCs
    local: dict[str, str] = field(default_factory=dict)  # this transaction's (set_config …, true)
    xact_start: datetime | None = None  # None: not in a transaction
    state_change: datetime | None = None
    backend_start: datetime | None = None

    def set_lease(self, ms: str | None, xact: bool) -> None:
        """``set_lease``: arm the lease (NULL: leave it)."""
        if ms is None:
            return
        if xact:
            self.local["idle_in_transaction_session_timeout"] = ms
        else:
            self.settings["idle_session_timeout"] = ms

    def label(self, name: str | None) -> None:
        """``label_session`` (NULL: leave it)."""
        if name is not None:
            self.settings["application_name"] = name


@dataclass
class Holdings:
    session: Counter[Key] = field(default_factory=Counter)
    xact: set[Key] = field(default_factory=set)

    def __contains__(self, key: Key) -> bool:
        return key in self.session or key in self.xact


class AdvisoryLocks:
    """Which session holds which advisory lock."""

    def __init__(self) -> None:
        self._by_pid: dict[int, Holdings] = {}

    def _of(self, pid: int) -> Holdings:
        return self._by_pid.setdefault(pid, Holdings())

    def holds(self, pid: int | None, key: Key) -> bool:
        """``holds_lock``: whether session ``pid`` holds ``key``."""
        return pid is not None and pid in self._by_pid and key in self._by_pid[pid]

    def try_lock(self, pid: int, key: Key, *, xact: bool) -> bool:
        """``pg_try_advisory_lock`` (``xact``: ``pg_try_advisory_xact_lock``)."""
        if any(key in held for other, held in self._by_pid.items() if other != pid):
            return False
        held = self._of(pid)
        if xact:
            held.xact.add(key)
        else:
            held.session[key] += 1
        return True

    def count(self, pid: int) -> int:
        """How many advisory locks session ``pid`` holds (a re-entrant one once)."""
        held = self._by_pid.get(pid)
        return 0 if held is None else len(set(held.session) | held.xact)

    def unlock(self, pid: int, key: Key) -> bool:
        """``pg_advisory_unlock``: one hold of a session-level lock fewer."""
        held = self._of(pid)
        if held.session[key] <= 0:
            return False
        held.session[key] -= 1
        if not held.session[key]:
            del held.session[key]
        return True

    def unlock_all(self, pid: int) -> bool:
        """``pg_advisory_unlock_all``: every session-level lock of ``pid``."""
        self._of(pid).session.clear()
        return True

    def end_transaction(self, pid: int) -> None:
        self._of(pid).xact.clear()

    def drop(self, pid: int) -> None:
        """The session ended: everything it held is free."""
        self._by_pid.pop(pid, None)

    def holders(self, keys: list[int], *, besides: int) -> list[tuple[int, int]]:
        """(pid, key) of every session but ``besides`` holding one of ``keys``."""
        return [
            (pid, key)
            for pid, held in sorted(self._by_pid.items())
            for key in keys
            if pid != besides and key in held
        ]


Handler = Callable[[Caller, Params], list[Row]]


class LockStatements:
    """The lock statements' twins, on ``tables`` and ``locks``; ``callers`` finds a live
    session by its pid (a holder named by a skip)."""

    def __init__(
        self,
        tables: InMemoryStatements,
        locks: AdvisoryLocks,
        callers: Callable[[int], Caller | None],
    ) -> None:
        self.tables = tables
        self.locks = locks
        self._callers = callers
        self._tokens = itertools.count(1)
        self.handlers: dict[str, Handler] = {
            "acquire": self._acquire,
            "acquire_mutex": self._acquire_mutex,
            "release": self._release,
            "release_unwaited": self._release_unwaited,
            "unlock_shared": self._unlock_shared,
            "skip": self._skip,
            "record_outcome": self._record_outcome,
            "record_failure_after_rollback": self._record_failure_after_rollback,
        }

    @property
    def now(self) -> datetime:
        return self.tables.now

    @property
    def runs(self) -> dict[tuple[str, str], Row]:
        return self.tables.data.runs

    # -- acquire ------------------------------------------------------------------------

    def _acquire(self, caller: Caller, p: Params) -> list[Row]:
        lock = self._grant(caller, p)
        newer_slot, late = self._newer_slot(p), self._late(p)
        attempts = None
        if lock["acquired"] and newer_slot is None and not late:
            attempts = self._claim(caller, p, lock)
        return [lock | {"attempts": attempts, "newer_slot": newer_slot, "late": late}]

    def _acquire_mutex(self, caller: Caller, p: Params) -> list[Row]:
        return [self._grant(caller, p) | {"attempts": None, "newer_slot": None, "late": False}]

    def _grant(self, caller: Caller, p: Params) -> Row:
        """``grant_lock``: the lock, a token, the lease armed, the label, the holder row."""
        keys, xact = list(p["keys"]), bool(p["xact"])
        if len(keys) > 1:
            key = self._try_lock_any(caller, keys, _slot_lock(p), xact)
        else:
            key = keys[0] if self.locks.try_lock(caller.pid, keys[0], xact=xact) else None
        if key is None:
            return {"acquired": False, "key": None, "token": None}
        caller.label(p["application_name"])
        token = next(self._tokens)
        holder = {"lock_key": key, "backend_pid": caller.pid, "token": token, "since": self.now}
        holder |= {name: p[name] for name in ("lock_name", "slot", "task_id", "host", "pid")}
        self.tables.data.holders[key] = holder | {"concurrency": p["concurrency"]}
        caller.set_lease(p["lease_ms"], xact)
        return {"acquired": True, "key": key, "token": token}

    def _try_lock_any(
        self, caller: Caller, keys: list[int], slot_lock: tuple[int, int] | None, xact: bool
    ) -> int | None:
        """``try_lock_any``: the slot's own lock first, then the first free key."""
        if slot_lock is not None and not self.locks.try_lock(caller.pid, slot_lock, xact=xact):
            return None
        for key in keys:
            if self.locks.try_lock(caller.pid, key, xact=xact):
                return key
        if slot_lock is not None and not xact:
            self.locks.unlock(caller.pid, slot_lock)
        return None

    def _newer_slot(self, p: Params) -> str | None:
        """A newer time slot of the lock (and entry) that succeeded, when coalescing."""
        if p["newer_than"] is None:
            return None
        found = [
            slot
            for (lock_name, slot), run in self.runs.items()
            if lock_name == p["lock_name"]
            and slot > p["newer_than"]
            and run["state"] == "succeeded"
            and re.search(p["slot_pattern"], slot)
            and (p["entry"] is None or run.get("entry") == p["entry"])
        ]
        return max(found, default=None)

    def _late(self, p: Params) -> bool:
        if p["slot_time"] is None or p["max_lateness"] is None:
            return False
        return parse_slot(p["slot_time"]) < self.now - timedelta(seconds=p["max_lateness"])

    def _claim(self, caller: Caller, p: Params, lock: Row) -> int | None:
        """The ledger claim: a new row ``running``, or one taken over, never a succeeded
        one nor one another live session runs."""
        row = self.runs.get((p["lock_name"], p["slot"]))
        claimed = {"state": "running", "token": lock["token"], "lock_key": lock["key"]}
        claimed |= {name: p[name] for name in ("task_id", "task_name", "host", "pid")}
        claimed |= {"backend_pid": caller.pid, "started_at": self.now}
        if row is None:
            made = claimed | {"attempts": 1, "entry": p["entry"]}
            self.tables.add_run(p["lock_name"], p["slot"], **made)
            return 1
        runs_elsewhere = row["state"] == "running" and row.get("backend_pid") != caller.pid
        if row["state"] == "succeeded" or (
            runs_elsewhere and self.locks.holds(row.get("backend_pid"), row["lock_key"])
        ):
            return None
        row.update(claimed, attempts=row["attempts"] + 1, finished_at=None, reason=None)
        row.update(updated_at=self.now, entry=row.get("entry") or p["entry"])
        return int(row["attempts"])

    # -- release ------------------------------------------------------------------------

    def _release(self, caller: Caller, p: Params) -> list[Row]:
        row = self.runs.get((p["lock_name"], p["slot"]))
        recorded = 0
        if row is not None and row["token"] == p["token"] and row["state"] == "running":
            self._finish(row, p["state"], p["reason"])
            recorded = 1
        if p["held_key"] is None:
            self.locks.unlock_all(caller.pid)
        else:
            self.locks.unlock(caller.pid, p["held_key"])
            if (slot_lock := _slot_lock(p)) is not None:
                self.locks.unlock(caller.pid, slot_lock)
        caller.set_lease(p["disarm_ms"], False)
        caller.label(p["idle_application_name"])
        return [{"recorded": recorded}]

    def _release_unwaited(self, caller: Caller, p: Params) -> list[Row]:
        """Its parameters are positional ($1 the lease to put back, $2 the label)."""
        self.locks.unlock_all(caller.pid)
        caller.set_lease(p["1"], False)
        caller.label(p["2"])
        return []

    def _unlock_shared(self, caller: Caller, p: Params) -> list[Row]:
        released = sum(self.locks.unlock(caller.pid, key) for key in p["keys"])
        slot_lock = _slot_lock(p)
        freed = self.locks.unlock(caller.pid, slot_lock) if slot_lock is not None else None
        return [{"released": released, "slot_released": freed}]

    def _finish(self, row: Row, state: str, reason: str | None) -> None:
        row.update(state=state, reason=reason, finished_at=self.now, updated_at=self.now)

    def _record_outcome(self, caller: Caller, p: Params) -> list[Row]:
        row = self.runs.get((p["lock_name"], p["slot"]))
        if row is None or row["token"] != p["token"]:
            return []
        abandoned = row["state"] == "failed" and (row["reason"] or "").startswith("abandoned:")
        if row["state"] != "running" and not abandoned:
            return []
        self._finish(row, p["state"], p["reason"])
        return [{"?column?": 1}]

    def _record_failure_after_rollback(self, caller: Caller, p: Params) -> list[Row]:
        row = self.runs.get((p["lock_name"], p["slot"]))
        attempt = {"token": p["token"], "task_id": p["task_id"], "host": p["host"]}
        attempt |= {"pid": p["pid"], "started_at": self.now}
        if row is None:
            made = attempt | {"attempts": 1, "task_name": p["task_name"], "lock_key": p["key"]}
            made |= {"finished_at": self.now, "reason": p["reason"]}
            self.tables.add_run(p["lock_name"], p["slot"], "failed", **made)
        elif row["state"] in ("scheduled", "failed", "skipped"):
            row.update(attempt, attempts=row["attempts"] + 1)
            self._finish(row, "failed", p["reason"])
        return []

    # -- skip ---------------------------------------------------------------------------

    def _skip(self, caller: Caller, p: Params) -> list[Row]:
        """Log the skip and explain it; every part reads the tables as the statement
        found them (one snapshot), as its CTEs do."""
        released = self.locks.unlock_all(caller.pid) if p["held"] else None
        found = self.runs.get((p["lock_name"], p["slot"]))
        run = dict(found) if found is not None else None
        holder = self._holder(caller, p)
        newer = self.runs.get((p["lock_name"], p["newer_slot"])) if p["newer_slot"] else None
        abandoned = self._abandon(found, p["abandoned_reason"])
        succeeded = run is not None and run["state"] == "succeeded"
        reason = "done" if succeeded else "superseded" if self._ahead(holder, p) else p["reason"]
        if not (p["buffer"] and reason == "locked"):
            self._log_skip(p, reason, run, holder, newer, succeeded=succeeded)
            if found is not None and found["state"] in ("scheduled", "waiting"):
                self._finish(found, "skipped", reason)
        answer: Row = {"reason": reason, "released": released, "abandoned_token": abandoned}
        answer |= _prefixed("run", run, ["state", "token", "task_id", "host", "pid"])
        answer |= _prefixed("run", run, ["finished_at"])
        answer |= _holder_columns(holder)
        answer |= {"newer_slot": newer["slot"] if newer else None}
        answer |= _prefixed("newer", newer, ["token", "task_id", "host", "pid", "finished_at"])
        return [answer]

    def _holder(self, caller: Caller, p: Params) -> Row | None:
        """The live holder of one of the claim's keys (another session), the one that
        runs this slot first; its holder row when it is that session's."""
        found: list[Row] = []
        for pid, key in self.locks.holders(list(p["keys"]), besides=caller.pid):
            session = self._callers(pid)
            if session is None:
                continue
            row = self.tables.data.holders.get(key)
            mine = row if row is not None and row["backend_pid"] == pid else {}
            found.append(
                {
                    "backend_pid": pid,
                    "application_name": session.settings.get("application_name"),
                    "xact_start": session.xact_start or session.state_change,
                }
                | {name: mine.get(name) for name in ("task_id", "host", "pid", "since", "token")}
                | {"slot": mine.get("slot")}
            )
        found.sort(key=lambda holder: holder["slot"] != p["slot"])
        return found[0] if found else None

    def _ahead(self, holder: Row | None, p: Params) -> bool:
        """The live holder runs a newer time slot of the lock (and entry), coalescing."""
        if holder is None or holder["slot"] is None or p["newer_than"] is None:
            return False
        if not (holder["slot"] > p["newer_than"] and re.search(p["slot_pattern"], holder["slot"])):
            return False
        run = self.runs.get((p["lock_name"], holder["slot"]))
        return p["entry"] is None or (run is not None and run.get("entry") == p["entry"])

    def _abandon(self, row: Row | None, reason: str) -> int | None:
        """A ``running`` row whose session no longer holds its lock: recorded failed."""
        if row is None or row["state"] != "running":
            return None
        if self.locks.holds(row.get("backend_pid"), row["lock_key"]):
            return None
        self._finish(row, "failed", reason)
        return int(row["token"])

    def _log_skip(
        self,
        p: Params,
        reason: str,
        run: Row | None,
        holder: Row | None,
        newer: Row | None,
        *,
        succeeded: bool,
    ) -> None:
        if succeeded:
            assert run is not None
            who = run["task_id"]
        else:
            candidates = [
                (holder or {}).get("task_id"),
                p["local_holder"],
                (newer or {}).get("task_id"),
                (run or {}).get("task_id"),
            ]
            who = next((task_id for task_id in candidates if task_id is not None), None)
        columns = {name: p[name] for name in ("task_id", "task_name", "host", "pid")}
        self.tables.add_skip(p["lock_name"], p["slot"], reason, **columns, holder_task_id=who)


def _slot_lock(p: Params) -> tuple[int, int] | None:
    found = p.get("slot_lock")
    return (int(found[0]), int(found[1])) if found else None


def _prefixed(prefix: str, row: Row | None, columns: list[str]) -> Row:
    return {f"{prefix}_{name}": (row or {}).get(name) for name in columns}


def _holder_columns(holder: Row | None) -> Row:
    found: dict[str, Any] = holder or {}
    answer = {name: found.get(name) for name in ("backend_pid", "application_name", "xact_start")}
    columns = ("task_id", "host", "pid", "since", "token", "slot")
    return answer | {f"holder_{name}": found.get(name) for name in columns}
