"""What an operator asks at 3 AM, as functions: who holds what, what ran, end a holder.

``celery pglock status|runs|release`` are thin shells around these; they are usable from
Python too (a health check, a dashboard). Every function takes the store's ``Statements``
(``OnConnection(conn, tables)`` on an open connection), reads PostgreSQL's own view of
advisory locks (``pg_locks`` joined with ``pg_stat_activity``) together with our tables,
and returns plain JSON-ready dicts.

Lock names: ``pg_locks`` only knows 64-bit keys. A name is found in the ``holders`` table
(every session-scope grant, and every committed transaction-scope one) or among the names
the caller passes (the app's tasks, the beat leader lock). A transaction-scope holder's
uncommitted rows are invisible to others, so who it is comes from the
``application_name`` it set (``pglock <pid> <task id> <host>``).
"""

from __future__ import annotations

import getpass
import logging
import re
import socket
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

from celery_pglock._config import Settings
from celery_pglock._keys import leader_lock_name, lock_key, lock_keys
from celery_pglock._ledger import parse_application_name
from celery_pglock.errors import SchemaMissing
from celery_pglock.schema import Tables
from celery_pglock.store.statements import Statements, opened

logger = logging.getLogger("celery_pglock")

Row = dict[str, Any]

RUN_STATES = ("scheduled", "running", "succeeded", "failed", "skipped", "paused", "waiting")
RELEASE_WAIT = 5.0  # seconds to wait for terminated sessions to let go of the lock
_OUR_SESSION = re.compile(r"^celery-pglock(?P<role>.*?) (?P<pid>\d+)@(?P<host>.+)$")
_LIKE_SPECIAL = re.compile(r"([\\%_])")


def operator() -> str:
    """``user@host`` of whoever runs this process, for audit lines."""
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no login name and no passwd entry (containers)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def jsonable(value: Any) -> Any:
    """``value`` with datetimes as ISO-8601 strings and decimals as floats, recursively."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Decimal):
        return float(value)
    if isinstance(value, Mapping):
        return {str(key): jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    return value


def require_tables(statements: Statements) -> int:
    """The schema version, or ``SchemaMissing`` saying where we looked and what to do."""
    version = statements.schema_version()
    tables = statements.tables
    if version is None:
        raise SchemaMissing(
            f"no celery-pglock tables in schema {tables.schema!r} with prefix "
            f"{tables.prefix!r}: nothing has run yet, or pglock_schema/pglock_table_prefix "
            "differ from the workers' (`celery pglock migrate` creates the tables)"
        )
    return version


# -- who holds what ----------------------------------------------------------------------


def describe_session(row: Row) -> Row:
    """Who a lock session belongs to: holder row, else the application_name we set. A
    lock held on rows (``lock_backend`` "rows") has no session: its row says who holds it,
    until ``expires_at`` unless renewed."""
    app_name = row.get("application_name")
    if row.get("recorded"):
        who = {"host": row["host"], "pid": row["pid"], "task_id": row["task_id"]}
        who.update(scope="session", slot=row["slot"], token=row["token"], since=row["since"])
    elif app_name and app_name.startswith("pglock "):
        who = {**parse_application_name(app_name), "scope": "transaction"}
        who.update(slot=None, token=None, since=row.get("xact_start"))
    else:
        who = {**_our_session(app_name), "scope": None, "slot": None, "token": None}
        who["since"] = None
    on_rows = row.get("expires_at") is not None
    who.update(
        backend_pid=row["backend_pid"],
        application_name=app_name,
        client_addr=row.get("client_addr"),
        user=row.get("usename"),
        lock_backend="rows" if on_rows else "advisory",
    )
    if on_rows:
        who["expires_at"] = row["expires_at"]
    if "other_locks" in row:  # a lock's holders (``holders``): what else its session holds
        who["other_locks"] = row["other_locks"]
    return who


def _our_session(app_name: str | None) -> Row:
    match = _OUR_SESSION.match(app_name or "")
    if match is None:
        return {"host": None, "pid": None, "task_id": None}
    return {"host": match["host"], "pid": int(match["pid"]), "task_id": None}


def _waiter(row: Row) -> Row:
    who = describe_session(row)
    return {**who, "scope": None, "since": None, "waiting_since": row.get("query_start")}


def locks(
    statements: Statements,
    known_names: Iterable[str] = (),
    limits: Mapping[str, int] | None = None,
) -> list[Row]:
    """Advisory locks of this app: one dict per key with its holder and its waiters.
    ``limits``: the ``pglock_concurrency`` of known lock names, so that each of their N
    keys is named even before a holder row of it is committed (transaction scope)."""
    limits = limits or {}
    named = [
        (key, name)
        for name in sorted(set(known_names))
        for key in lock_keys(name, limits.get(name, 1))
    ]
    params = {"keys": [key for key, _ in named], "names": [name for _, name in named]}
    found: dict[int, Row] = {}
    for row in statements.rows("ops_locks", params):
        entry = found.setdefault(
            row["lock_key"],
            {
                "lock": row["lock_name"],
                "key": row["lock_key"],
                "holder": None,
                "waiters": [],
                # 0: a slot's own lock (pglock_overlap "allow"): duplicates only
                "concurrency": limits.get(row["lock_name"], 1)
                if row["concurrency"] is None
                else row["concurrency"],
            },
        )
        if row["granted"] and entry["holder"] is None:
            entry["holder"] = describe_session(row)
        elif not row["granted"]:
            entry["waiters"].append(_waiter(row))
    return _count_held(list(found.values()))


def _count_held(found: list[Row]) -> list[Row]:
    """Add ``held``: how many of its lock name's ``concurrency`` keys are held."""
    held: dict[str | None, int] = {}
    for entry in found:
        if entry["holder"] is not None:
            held[entry["lock"]] = held.get(entry["lock"], 0) + 1
    return [{**entry, "held": held.get(entry["lock"], 0)} for entry in found]


def beat_view(all_locks: Iterable[Row], namespace: str) -> Row:
    """The beat leader and the standbys waiting to take over, from the leader lock."""
    name = leader_lock_name(namespace)
    key = lock_key(name)
    entry = next((lock for lock in all_locks if lock["key"] == key), None)
    leader = entry["holder"] if entry else None
    standbys = entry["waiters"] if entry else []
    return {"lock": name, "key": key, "leader": leader, "standbys": standbys}


def running(statements: Statements, limit: int = 100) -> list[Row]:
    """Ledger rows in state ``running``; ``holder_alive`` false means an orphan."""
    return statements.rows("ops_running", {"limit": limit})


def recent_skips(statements: Statements, limit: int = 20) -> list[Row]:
    """The newest entries of the skip log."""
    return statements.rows("ops_recent_skips", {"limit": limit})


@dataclass(frozen=True)
class Status:
    """Everything ``celery pglock status`` shows."""

    namespace: str
    tables: Tables
    locks: list[Row]
    beat: Row
    running: list[Row]
    skips: list[Row]
    rogue: list[Row]  # slot-less messages of scheduled tasks, last day (a stock beat?)
    waiting: list[Row]  # slots that wait their turn (pglock_overlap = "buffer_one")

    def as_json(self) -> Row:
        payload: Row = jsonable(
            {
                "namespace": self.namespace,
                "schema": self.tables.schema,
                "table_prefix": self.tables.prefix,
                "locks": self.locks,
                "beat": self.beat,
                "running": self.running,
                "skips": self.skips,
                "rogue_sends": self.rogue,
                "waiting": self.waiting,
            }
        )
        return payload


def status(
    statements: Statements,
    *,
    namespace: str,
    known_names: Iterable[str] = (),
    limits: Mapping[str, int] | None = None,
    skips: int = 20,
) -> Status:
    """Held locks (without the beat leader lock), beat, running rows and recent skips."""
    require_tables(statements)
    leader = leader_lock_name(namespace)
    found = locks(statements, [*known_names, leader], limits)
    return Status(
        namespace=namespace,
        tables=statements.tables,
        locks=[lock for lock in found if lock["lock"] != leader],
        beat=beat_view(found, namespace),
        running=running(statements),
        skips=recent_skips(statements, skips) if skips > 0 else [],
        rogue=statements.rows("ops_rogue_sends", {"namespace": namespace}),
        waiting=statements.rows("waiting_slots", {"limit": 100}),
    )


# -- history -----------------------------------------------------------------------------


def like_pattern(text: str) -> str:
    """A LIKE pattern matching ``text`` exactly, except that ``*`` matches anything."""
    return _LIKE_SPECIAL.sub(r"\\\1", text).replace("*", "%")


def runs(
    statements: Statements,
    *,
    task: str | None = None,
    since: datetime | None = None,
    state: str | None = None,
    limit: int = 50,
) -> list[Row]:
    """Ledger history, newest first, with duration and skip counts per run."""
    require_tables(statements)
    if state is not None and state not in RUN_STATES:
        raise ValueError(f"state must be one of {RUN_STATES}, got {state!r}")
    params = {
        "task": like_pattern(task) if task else None,
        "since": since,
        "state": state,
        "limit": limit,
    }
    return statements.rows("ops_runs", params)


# -- ending a holder ---------------------------------------------------------------------


def holders(statements: Statements, name: str) -> list[Row]:
    """Who holds lock ``name`` right now (normally one session; empty if free)."""
    require_tables(statements)
    params = {"keys": lock_keys_of(statements, name)}
    return [describe_session(row) for row in statements.rows("ops_lock_holders", params)]


def lock_keys_of(statements: Statements, name: str) -> list[int]:
    """The advisory keys of lock ``name``: its own, and those of its further runs at once
    (``pglock_concurrency``) that its holder rows name."""
    rows = statements.rows("ops_lock_keys", {"name": name})
    return sorted({lock_key(name), *(row["lock_key"] for row in rows)})


@dataclass(frozen=True)
class ForcedRelease:
    """What ``force_release`` did: the sessions ended, and whether they let go in time."""

    lock: str
    key: int
    terminated: list[Row]
    released: bool
    operator: str

    def as_json(self) -> Row:
        payload: Row = jsonable(self.__dict__)
        return payload


def force_release(
    statements: Statements, name: str, *, wait: float = RELEASE_WAIT
) -> ForcedRelease | None:
    """End the session(s) holding ``name`` (``pg_terminate_backend``); None if it is free.

    The server frees a session's advisory locks when it ends it; the holder learns on its
    next use of the connection (its lease heartbeat, at most a third of the lease later)
    and reports ``lock_lost``. A lock held on rows is freed by deleting its row; its holder
    learns at its next renewal. The operator is logged at WARNING: ending someone's session
    is an action to be able to trace.
    """
    found = holders(statements, name)
    if not found:
        return None
    key = lock_key(name)
    keys = lock_keys_of(statements, name)
    on_rows = [h for h in found if h["lock_backend"] == "rows"]
    on_sessions = [h for h in found if h["lock_backend"] == "advisory"]
    params = {"keys": keys, "pids": [h["backend_pid"] for h in on_sessions]}
    ended = {row["backend_pid"] for row in statements.rows("ops_terminate", params)}
    terminated = [h for h in on_sessions if h["backend_pid"] in ended]
    terminated += _release_rows(statements, keys, on_rows)
    done = ForcedRelease(
        name, key, terminated, _wait_released(statements, params, wait), operator()
    )
    for holder in terminated:
        _log_release(done, holder)
    return done


def _release_rows(statements: Statements, keys: list[int], found: list[Row]) -> list[Row]:
    """Delete the rows of the holders on rows in ``found``: those it freed."""
    if not found:
        return []
    params = {"keys": keys, "tokens": [h["token"] for h in found]}
    freed = {row["token"] for row in statements.rows("ops_release_rows", params)}
    return [h for h in found if h["token"] in freed]


def _wait_released(statements: Statements, params: Row, wait: float) -> bool:
    """Poll until the ended sessions no longer hold the lock (termination is asynchronous)."""
    deadline = time.monotonic() + wait
    while True:
        row = statements.row("ops_still_held", params)
        if row is None or row["held"] == 0:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def _log_release(done: ForcedRelease, holder: Row) -> None:
    pid = holder["backend_pid"]
    logger.warning(
        "lock %r released by %s: %s (holder %s pid %s task %s)",
        done.lock,
        done.operator,
        "deleted its row" if pid is None else f"terminated backend {pid}",
        holder.get("host"),
        holder.get("pid"),
        holder.get("task_id"),
        extra={
            "action": "pglock_lock_released",
            "lock": done.lock,
            "slot": holder.get("slot"),
            "token": holder.get("token"),
            "operator": done.operator,
            "backend_pid": holder["backend_pid"],
        },
    )


# -- schema ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Migrated:
    applied: list[int]
    version: int
    schema: str
    table_prefix: str

    def as_json(self) -> Row:
        return dict(self.__dict__)


def migrate(settings: Settings, **connect_overrides: Any) -> Migrated:
    """Create or upgrade the tables now (what workers otherwise do on first use)."""
    tables = settings.tables
    with opened(settings, **connect_overrides) as statements:
        applied = statements.migrate()
        version = statements.schema_version() or 0
    return Migrated(applied, version, tables.schema, tables.prefix)
