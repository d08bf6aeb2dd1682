"""The in-memory twin of the operator's statements on held locks (``sql/ops_queries.sql``:
``ops_lock_keys``, ``ops_lock_holders``, ``ops_terminate``, ``ops_still_held``), on the
sessions of an ``InMemoryServer`` (``memory_sessions``): who holds a lock now, as
``pg_locks`` joined with ``pg_stat_activity`` and the holder rows shows it, and ending
the holders' sessions as ``pg_terminate_backend`` does (at once, here)."""

from __future__ import annotations

from collections.abc import Callable

from celery_pglock.store._memory import InMemoryStatements
from celery_pglock.store._memory_locks import AdvisoryLocks, Caller, Handler
from celery_pglock.store.statements import Params, Row


class OpsStatements:
    """The held-lock statements' twins; ``callers`` finds a live session by its pid,
    ``terminate`` ends one."""

    def __init__(
        self,
        tables: InMemoryStatements,
        locks: AdvisoryLocks,
        callers: Callable[[int], Caller | None],
        terminate: Callable[[int], bool],
    ) -> None:
        self.tables = tables
        self.locks = locks
        self._callers = callers
        self._terminate = terminate
        self.handlers: dict[str, Handler] = {
            "ops_lock_keys": self._lock_keys,
            "ops_lock_holders": self._lock_holders,
            "ops_terminate": self._end_holders,
            "ops_still_held": self._still_held,
        }

    def _lock_keys(self, caller: Caller, p: Params) -> list[Row]:
        holders = self.tables.data.holders.values()
        keys = {row["lock_key"] for row in holders if row["lock_name"] == p["name"]}
        return [{"lock_key": key} for key in sorted(keys)]

    def _lock_holders(self, caller: Caller, p: Params) -> list[Row]:
        found = []
        for pid, key in sorted(self._held(p["keys"], besides=caller.pid), key=lambda h: h[1]):
            session = self._callers(pid)
            if session is None:
                continue
            holder = self.tables.data.holders.get(key) or {}
            recorded = holder.get("backend_pid") == pid and holder["since"] >= session.backend_start
            others = self.locks.count(pid) - 1
            found.append(
                {"backend_pid": pid, "application_name": session.settings.get("application_name")}
                | {"client_addr": "127.0.0.1", "usename": "postgres"}
                | {"backend_start": session.backend_start, "xact_start": session.xact_start}
                | {"recorded": recorded, "other_locks": others}
                | {name: holder.get(name) for name in ("task_id", "host", "pid", "slot")}
                | {name: holder.get(name) for name in ("token", "since")}
            )
        return found

    def _end_holders(self, caller: Caller, p: Params) -> list[Row]:
        pids = {pid for pid, _ in self._held(p["keys"], besides=None) if pid in p["pids"]}
        return [{"backend_pid": pid, "terminated": self._terminate(pid)} for pid in sorted(pids)]

    def _still_held(self, caller: Caller, p: Params) -> list[Row]:
        held = [pid for pid, _ in self._held(p["keys"], besides=None) if pid in p["pids"]]
        return [{"held": len(held)}]

    def _held(self, keys: list[int], *, besides: int | None) -> list[tuple[int, int]]:
        return self.locks.holders(list(keys), besides=-1 if besides is None else besides)
