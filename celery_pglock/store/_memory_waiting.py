"""The in-memory twin of the ``buffer_one`` statements (``sql/waiting_queries.sql``:
``lock_waiting``, ``wait_turn``, ``send_waiting``, ``replaced_meanwhile``,
``forget_waiting``): one slot waits per lock name, a newer time slot replaces it.

Each statement is answered as its SQL does, on the tables of an ``InMemoryStatements``
(the waiting slots, the ledger, the skips) and the ``AdvisoryLocks`` of ``memory_locks``
(whether a ``running`` row's session still holds its lock). ``lock_waiting``, which keeps
two decisions of one lock name apart, has nothing to do: the in-memory server answers
one statement at a time.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta

from celery_pglock.store._memory import InMemoryStatements
from celery_pglock.store._memory_locks import AdvisoryLocks, Caller
from celery_pglock.store.statements import Params, Row

# The columns ``send_waiting`` returns, as its SQL names them.
MESSAGE_COLUMNS = ["body", "content_type", "content_encoding", "headers", "exchange", "routing_key"]
SENT_COLUMNS = ["task_id", "task_name", "slot", *MESSAGE_COLUMNS]


class WaitingStatements:
    """The ``buffer_one`` statements' twins, on ``tables`` and ``locks``."""

    def __init__(self, tables: InMemoryStatements, locks: AdvisoryLocks) -> None:
        self.tables = tables
        self.locks = locks
        self.handlers: dict[str, Callable[[Caller, Params], list[Row]]] = {
            "lock_waiting": lambda caller, p: [{}],
            "wait_turn": self._wait_turn,
            "send_waiting": self._send_waiting,
            "replaced_meanwhile": self._replaced_meanwhile,
            "forget_waiting": self._forget_waiting,
        }

    @property
    def waiting(self) -> dict[str, Row]:
        return self.tables.data.waiting

    def _wait_turn(self, caller: Caller, p: Params) -> list[Row]:
        current = dict(self.waiting.get(p["lock_name"]) or {}) or None
        outcome = self._decided(p, current)
        replaced = False
        if outcome == "waiting":
            self._keep(p, current)
            self._mark_waiting(p)
            replaced = self._replace(p, current)
        elif outcome == "superseded":
            self._skip_superseded(p, current)
        other = current or {}
        answer = {"outcome": outcome, "other_slot": other.get("slot")}
        return [answer | {"other_task_id": other.get("task_id"), "replaced_waiting": replaced}]

    def _decided(self, p: Params, current: Row | None) -> str:
        run = self.tables.data.runs.get((p["lock_name"], p["slot"]))
        if run is not None and (
            run["state"] == "succeeded"
            or (
                run["state"] == "running"
                and self.locks.holds(run.get("backend_pid"), run["lock_key"])
            )
        ):
            return "taken"
        if current is None or current["slot"] <= p["slot"]:
            return "waiting"
        both_timed = all(re.search(p["slot_pattern"], s) for s in (p["slot"], current["slot"]))
        return "superseded" if both_timed else "waiting"

    def _keep(self, p: Params, current: Row | None) -> None:
        """The waiting row: this message, replacing the one before it."""
        same = current is not None and current["slot"] == p["slot"]
        now = self.tables.now
        row = {name: p[name] for name in ("lock_name", "slot", "task_id", "task_name", "entry")}
        row |= {name: p[name] for name in MESSAGE_COLUMNS} | {"lock_keys": list(p["keys"])}
        row |= {"waiting_since": current["waiting_since"] if same and current else now}
        row |= {"sends": current["sends"] if same and current else 0, "sent_at": None}
        self.waiting[p["lock_name"]] = row

    def _mark_waiting(self, p: Params) -> None:
        """The slot's ledger row is ``waiting`` (not one that succeeded or runs)."""
        run = self.tables.data.runs.get((p["lock_name"], p["slot"]))
        who = {name: p[name] for name in ("task_id", "task_name", "host", "pid")}
        if run is None:
            made = who | {"attempts": 0, "entry": p["entry"], "lock_key": p["key"]}
            self.tables.add_run(p["lock_name"], p["slot"], "waiting", **made)
        elif run["state"] not in ("succeeded", "running"):
            run.update(who, state="waiting", reason=None, finished_at=None)
            run.update(updated_at=self.tables.now, entry=run.get("entry") or p["entry"])

    def _replace(self, p: Params, current: Row | None) -> bool:
        """The slot that waited before (and still waits) is skipped as superseded."""
        if current is None or current["slot"] == p["slot"]:
            return False
        run = self.tables.data.runs.get((p["lock_name"], current["slot"]))
        if run is None or run["state"] != "waiting":
            return False
        self._supersede(run)
        self._log(p, current["slot"], current["task_id"], holder=p["task_id"])
        return True

    def _skip_superseded(self, p: Params, current: Row | None) -> None:
        assert current is not None
        self._log(p, p["slot"], p["task_id"], holder=current["task_id"])
        run = self.tables.data.runs.get((p["lock_name"], p["slot"]))
        if run is not None and run["state"] in ("scheduled", "waiting"):
            self._supersede(run)

    def _supersede(self, run: Row) -> None:
        now = self.tables.now
        run.update(state="skipped", reason="superseded", finished_at=now, updated_at=now)

    def _log(self, p: Params, slot: str, task_id: str, *, holder: str) -> None:
        who = {name: p[name] for name in ("task_name", "host", "pid")}
        self.tables.add_skip(
            p["lock_name"], slot, "superseded", task_id=task_id, holder_task_id=holder, **who
        )

    def _send_waiting(self, caller: Caller, p: Params) -> list[Row]:
        row = self.waiting.get(p["lock_name"])
        now = self.tables.now
        if row is None:
            return []
        resend = now - timedelta(seconds=p["resend_after"])
        if row["sent_at"] is not None and row["sent_at"] >= resend:
            return []
        row.update(sent_at=now, sends=row["sends"] + 1)
        return [{name: row[name] for name in SENT_COLUMNS}]

    def _replaced_meanwhile(self, caller: Caller, p: Params) -> list[Row]:
        found = [
            skip
            for skip in self.tables.data.skips
            if (skip["lock_name"], skip["slot"], skip["task_id"])
            == (p["lock_name"], p["slot"], p["task_id"])
            and skip["reason"] == "superseded"
        ]
        newest = sorted(found, key=lambda skip: skip["at"])[-1:]
        return [{"holder_task_id": skip["holder_task_id"]} for skip in newest]

    def _forget_waiting(self, caller: Caller, p: Params) -> list[Row]:
        row = self.waiting.get(p["lock_name"])
        if row is None or row["slot"] != p["slot"]:
            return []
        del self.waiting[p["lock_name"]]
        return [{"task_id": row["task_id"]}]
