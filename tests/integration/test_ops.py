"""Operator reads and maintenance (``celery_pglock.ops``, ``retention``) on a real PostgreSQL.

Locks are held by real processes (``start_holder``: a Python subprocess that takes a lock
with ``celery_pglock._locks.acquire`` and blocks, printing ``LOST`` when it learns it lost
it). Lock names are database-wide, so every test names its locks after its own schema.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from celery import Celery

from celery_pglock import ops, retention
from celery_pglock._config import Settings
from celery_pglock._keys import leader_lock_name, lock_key
from celery_pglock._ledger import FAILED, SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.beat import PgLockScheduler
from celery_pglock.beat._leader import LeaderElection
from celery_pglock.errors import ConfigurationError, SchemaMissing
from celery_pglock.schema import Tables
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import Database, close_all
from celery_pglock.store.statements import OnConnection
from tests.fixtures.procs import Proc, Procs, wait_until
from tests.integration.locking import Conn, claim, granted, lock_holders, open_database, skipped

pytestmark = pytest.mark.integration

SLOT = "2026-11-29T03:00:00Z"

HOLDER_CODE = """
import os, sys, threading
from celery_pglock import signals
from celery_pglock._config import Settings
from celery_pglock.store._database import database
from celery_pglock._keys import lock_key
from celery_pglock._protocol import Claim
from celery_pglock._locks import acquire
from celery_pglock._protocol import Lease

dsn, schema, name, scope, slot, task_id, lease = sys.argv[1:8]
lost = threading.Event()

def on_lost(sender=None, cause="", **_):
    print("LOST", cause, flush=True)
    lost.set()

signals.lock_lost.connect(on_lost, weak=False)
db = database(Settings(dsn=dsn, schema=schema))
claim = Claim(lock_name=name, key=lock_key(name), slot=slot or None, task_id=task_id,
              task_name="holder.task", pid=os.getpid())
granted = acquire(db, claim, scope, float(lease) or None)
assert isinstance(granted, Lease), granted
print("HELD", granted.token, granted.connection.info.backend_pid, flush=True)
lost.wait(120)
"""


HELD_LINE = re.compile(r"^HELD (\d+) (\d+)\n", re.MULTILINE)  # a whole line


class Holder:
    """A subprocess holding one lock; ``token``/``backend_pid`` as it reported them."""

    def __init__(self, proc: Proc, name: str, task_id: str) -> None:
        self.proc = proc
        self.name = name
        self.task_id = task_id
        # The whole line, not its first word: the log is read while it is written.
        held = wait_until(
            lambda: HELD_LINE.search(proc.log_text()), timeout=20, message="the HELD line"
        )
        self.token = int(held.group(1))
        self.backend_pid = int(held.group(2))


def start_holder(
    procs: Procs,
    dsn: str,
    schema: str,
    name: str,
    *,
    scope: str = "session",
    slot: str | None = None,
    task_id: str = "holder-task-1",
    lease: float = 1.0,
) -> Holder:
    """Start a process that takes lock ``name`` and keeps it until it learns it lost it."""
    args = (dsn, schema, name, scope, slot or "", task_id, str(lease))
    return Holder(procs.python("-c", HOLDER_CODE, *args, name="holder"), name, task_id)


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        yield connection


def lock_entry(found: list[dict[str, Any]], name: str) -> dict[str, Any]:
    matches = [entry for entry in found if entry["key"] == lock_key(name)]
    assert len(matches) == 1, f"{name!r} not (once) among {found!r}"
    return matches[0]


def execute(conn: Conn, db: Database, query: str, params: dict[str, Any] | None = None) -> None:
    conn.execute(db.tables.render(query), params or {})


# -- status ------------------------------------------------------------------------------


def test_status_shows_session_holder_with_who_since_and_running_row(
    db: Database, conn: Conn, procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """A session-scope holder shows its name, host, pid, task id, slot, token and since."""
    name = f"{pglock_schema}:nightly"
    holder = start_holder(procs, pg_dsn, pglock_schema, name, slot=SLOT, task_id="t-night")

    found = ops.status(OnConnection(conn, db.tables), namespace=pglock_schema)

    who = lock_entry(found.locks, name)["holder"]
    expected = {
        "scope": "session",
        "host": HOSTNAME,
        "pid": holder.proc.pid,
        "task_id": "t-night",
        "slot": SLOT,
        "token": holder.token,
        "backend_pid": holder.backend_pid,
    }
    assert expected == {key: who[key] for key in expected}
    assert datetime.now(timezone.utc) - who["since"] < timedelta(minutes=1)
    running = [row for row in found.running if row["lock_name"] == name]
    assert [(SLOT, True, holder.token)] == [
        (row["slot"], row["holder_alive"], row["token"]) for row in running
    ]


def test_status_names_transaction_holder_from_its_application_name(
    db: Database, conn: Conn, procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """A transaction-scope holder (rows uncommitted) is told apart by application_name."""
    name = f"{pglock_schema}:rollup"
    holder = start_holder(
        procs, pg_dsn, pglock_schema, name, scope="transaction", slot=SLOT, task_id="t-tx"
    )

    named = lock_entry(ops.locks(OnConnection(conn, db.tables), known_names=[name]), name)
    unnamed = lock_entry(ops.locks(OnConnection(conn, db.tables)), name)

    assert (name, None) == (named["lock"], unnamed["lock"])
    who = named["holder"]
    expected = {"scope": "transaction", "host": HOSTNAME, "pid": holder.proc.pid}
    expected.update(task_id="t-tx", backend_pid=holder.backend_pid)
    assert expected == {key: who[key] for key in expected}
    assert who["since"] is not None


def test_transaction_holder_is_not_mistaken_for_the_previous_run_on_its_backend(
    pg_dsn: str, pglock_schema: str, conn: Conn
) -> None:
    """A holder row left by an earlier run on the same connection does not describe the next."""
    name = f"{pglock_schema}:reused"
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1)) as one:
        first = granted(acquire(one, claim(name, "slot-1", "t-first"), "transaction", None))
        release(one, first, SUCCEEDED)
        second = granted(acquire(one, claim(name, "slot-2", "t-second"), "transaction", None))
        try:
            assert first.connection is second.connection  # the same server session
            who = lock_entry(ops.locks(OnConnection(conn, one.tables)), name)["holder"]
        finally:
            release(one, second, SUCCEEDED)

    assert ("transaction", "t-second") == (who["scope"], who["task_id"])


def test_skip_names_the_current_transaction_holder_not_a_previous_run(
    pg_dsn: str, pglock_schema: str, db: Database
) -> None:
    """A skipped message's meta names the run holding the lock now, not the backend's last."""
    name = f"{pglock_schema}:reused-skip"
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema, pool_size=1)) as one:
        first = granted(acquire(one, claim(name, "slot-1", "t-first"), "transaction", None))
        release(one, first, SUCCEEDED)
        second = granted(acquire(one, claim(name, "slot-2", "t-second"), "transaction", None))
        try:
            skip = skipped(acquire(db, claim(name, "slot-3", "t-dup"), "session", None))
        finally:
            release(one, second, SUCCEEDED)

    assert skip.holder is not None
    assert ("locked", "t-second") == (skip.reason, skip.holder["task_id"])


def test_status_shows_beat_leader_and_standby(db: Database, conn: Conn, pglock_schema: str) -> None:
    """The beat leader holds the leader lock; a standby is its waiter; both say where."""
    name = leader_lock_name(pglock_schema)
    elections = [
        LeaderElection(db.settings, lock_name=name, key=lock_key(name), lease=5.0) for _ in range(2)
    ]
    try:
        for election in elections:
            election.start()
        wait_until(lambda: any(e.is_leader() for e in elections), message="a leader")

        def beat() -> dict[str, Any] | None:
            view = ops.status(OnConnection(conn, db.tables), namespace=pglock_schema).beat
            return view if view["leader"] and view["standbys"] else None

        view = wait_until(beat, message="a leader and a standby in status")
    finally:
        for election in elections:
            election.close()

    leader, standby = view["leader"], view["standbys"][0]
    assert (HOSTNAME, os.getpid()) == (leader["host"], leader["pid"])
    assert (HOSTNAME, os.getpid()) == (standby["host"], standby["pid"])
    assert "beat leader" in leader["application_name"]
    assert "beat standby" in standby["application_name"]
    assert lock_key(name) == view["key"]


def test_running_row_of_killed_holder_is_flagged_gone(
    db: Database, conn: Conn, procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """A running row whose worker died stays `running`, flagged as no longer held."""
    name = f"{pglock_schema}:orphan"
    holder = start_holder(procs, pg_dsn, pglock_schema, name, slot=SLOT)

    holder.proc.kill()
    wait_until(lambda: not lock_holders(conn, name), message="the lock to be freed")

    rows = [row for row in ops.running(OnConnection(conn, db.tables)) if row["lock_name"] == name]
    assert [(SLOT, False)] == [(row["slot"], row["holder_alive"]) for row in rows]


def test_read_operations_need_the_tables(pg_dsn: str, pglock_schema: str, conn: Conn) -> None:
    """Reading an empty schema says where it looked and how to create the tables."""
    tables = Tables(pglock_schema)

    with pytest.raises(SchemaMissing, match="pglock migrate"):
        ops.status(OnConnection(conn, tables), namespace="x")
    with pytest.raises(SchemaMissing, match=pglock_schema):
        ops.runs(OnConnection(conn, tables))


# -- runs --------------------------------------------------------------------------------


def test_runs_report_attempts_tokens_duration_and_skips(
    db: Database, conn: Conn, pglock_schema: str
) -> None:
    """A slot that failed once, was skipped while running and after success, adds up."""
    name = f"{pglock_schema}:report"
    first = granted(acquire(db, claim(name, SLOT), "session", None))
    release(db, first, FAILED, "RuntimeError: boom")
    second = granted(acquire(db, claim(name, SLOT), "session", None))
    skipped(acquire(db, claim(name, SLOT), "session", None))  # while running: locked
    release(db, second, SUCCEEDED)
    skipped(acquire(db, claim(name, SLOT), "session", None))  # after success: done

    [run] = ops.runs(OnConnection(conn, db.tables), task=name)

    expected = {"state": "succeeded", "attempts": 2, "token": second.token, "skips": 2}
    assert expected == {key: run[key] for key in expected}
    assert {"locked": 1, "done": 1} == run["skip_reasons"]
    assert second.token > first.token
    assert 0 <= run["duration_seconds"] < 60


def test_runs_filter_by_task_state_since_and_limit(
    db: Database, conn: Conn, pglock_schema: str
) -> None:
    """--task (exact or *), --state, --since and --limit narrow the history."""
    prefix = f"{pglock_schema}:filter"
    for index, state in enumerate((SUCCEEDED, FAILED, SUCCEEDED)):
        lease = granted(acquire(db, claim(f"{prefix}-{index}", SLOT), "session", None))
        release(db, lease, state)
    execute(
        conn,
        db,
        "UPDATE {runs} SET updated_at = now() - interval '3 days' WHERE lock_name = %(n)s",
        {"n": f"{prefix}-2"},
    )

    def names(**filters: Any) -> list[str]:
        return sorted(
            row["lock_name"] for row in ops.runs(OnConnection(conn, db.tables), **filters)
        )

    assert [f"{prefix}-1"] == names(task=f"{prefix}-1")
    assert [f"{prefix}-{i}" for i in range(3)] == names(task=f"{prefix}-*")
    assert [f"{prefix}-1"] == names(task=f"{prefix}-*", state=FAILED)
    since = datetime.now(timezone.utc) - timedelta(days=1)
    assert [f"{prefix}-0", f"{prefix}-1"] == names(task=f"{prefix}-*", since=since)
    assert 1 == len(names(task=f"{prefix}-*", limit=1))
    assert [] == names(task=f"{prefix}_%")  # LIKE wildcards in a name are literal


# -- release -----------------------------------------------------------------------------


def test_release_ends_holder_session_and_holder_notices(
    db: Database, conn: Conn, procs: Procs, pglock_schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """release() terminates the holder's backend, the lock is free, the holder learns it."""
    name = f"{pglock_schema}:stuck"
    holder = start_holder(procs, db.settings.dsn, pglock_schema, name, task_id="t-stuck")

    with caplog.at_level(logging.WARNING, logger="celery_pglock"):
        done = ops.force_release(OnConnection(conn, db.tables), name)

    assert done is not None
    assert done.released
    assert [holder.backend_pid] == [h["backend_pid"] for h in done.terminated]
    assert [] == lock_holders(conn, name)
    holder.proc.wait_for_log("LOST", timeout=10)
    [audit] = [r for r in caplog.records if getattr(r, "action", "") == "pglock_lock_released"]
    assert (name, ops.operator(), holder.backend_pid) == (
        audit.lock,  # type: ignore[attr-defined]
        audit.operator,  # type: ignore[attr-defined]
        audit.backend_pid,  # type: ignore[attr-defined]
    )


def test_release_of_a_free_lock_does_nothing(db: Database, conn: Conn, pglock_schema: str) -> None:
    """Releasing a lock nobody holds returns None and ends no session."""
    assert ops.force_release(OnConnection(conn, db.tables), f"{pglock_schema}:free") is None


# -- prune -------------------------------------------------------------------------------

INSERT_RUN = (
    "INSERT INTO {runs} (lock_name, slot, lock_key, state, backend_pid, updated_at) "
    "VALUES (%(n)s, %(s)s, %(k)s, %(state)s, %(backend)s, now() - make_interval(days => %(age)s))"
)
INSERT_SKIP = (
    "INSERT INTO {skips} (lock_name, slot, reason, at) "
    "VALUES (%(n)s, %(s)s, 'locked', now() - make_interval(days => %(age)s))"
)
INSERT_HOLDER = (
    "INSERT INTO {holders} (lock_key, lock_name, backend_pid, since) "
    "VALUES (%(k)s, %(n)s, %(backend)s, now() - make_interval(days => %(age)s))"
)
INSERT_SEND = (
    "INSERT INTO {beat_sends} (namespace, entry, slot, sent_by, claimed_at) "
    "VALUES ('ns', %(n)s, %(s)s, 'test', now() - make_interval(days => %(age)s))"
)


def add_run(
    conn: Conn, db: Database, name: str, state: str, age_days: int, *, backend: int | None = None
) -> None:
    params = {"n": name, "s": SLOT, "k": lock_key(name), "state": state}
    execute(conn, db, INSERT_RUN, {**params, "backend": backend, "age": age_days})


def remaining(conn: Conn, db: Database, table: str, column: str) -> list[str]:
    query = db.tables.render(f"SELECT {column} FROM {{{table}}} ORDER BY 1")
    return [row[0] for row in conn.execute(query).fetchall()]


def test_prune_deletes_only_what_retention_allows(
    db: Database, conn: Conn, procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """Old finished/orphaned rows, skips, sends and holder rows go; young rows and live
    holders stay."""
    live = f"{pglock_schema}:live"
    holder = start_holder(procs, pg_dsn, pglock_schema, live, slot=SLOT)
    execute(conn, db, "UPDATE {runs} SET updated_at = now() - interval '30 days'")
    execute(conn, db, "UPDATE {holders} SET since = now() - interval '30 days'")
    for name, state, age in [
        ("old-ok", "succeeded", 8),
        ("old-failed", "failed", 8),
        ("old-orphan", "running", 8),
        ("old-scheduled", "scheduled", 8),
        ("young-ok", "succeeded", 6),
        ("young-running", "running", 1),
    ]:
        add_run(conn, db, name, state, age, backend=holder.backend_pid)
    for name, age in [("old", 8), ("young", 6)]:
        execute(conn, db, INSERT_SKIP, {"n": name, "s": SLOT, "age": age})
        execute(conn, db, INSERT_SEND, {"n": name, "s": SLOT, "age": age})
        holder_row = {"n": f"{name}-holder", "k": lock_key(f"{name}-holder"), "age": age}
        execute(conn, db, INSERT_HOLDER, {**holder_row, "backend": holder.backend_pid})

    done = retention.prune(OnConnection(conn, db.tables), timedelta(days=7))

    assert {"runs": 4, "skips": 1, "beat_sends": 1, "holders": 1, "row_locks": 0} == done.deleted
    assert done.complete
    assert [live, "young-ok", "young-running"] == remaining(conn, db, "runs", "lock_name")
    assert ["young"] == remaining(conn, db, "skips", "lock_name")
    assert ["young"] == remaining(conn, db, "beat_sends", "entry")
    assert [live, "young-holder"] == remaining(conn, db, "holders", "lock_name")


def test_prune_goes_in_batches_and_never_waits_for_a_locked_row(
    db: Database, conn: Conn, pg_dsn: str
) -> None:
    """Batches of `batch` rows delete everything old, except a row a claim has locked."""
    for index in range(5):
        add_run(conn, db, f"batch-{index}", "succeeded", 10)
    claimant = psycopg.connect(pg_dsn)  # a claim in progress holds its row lock
    try:
        claimant.execute(
            db.tables.render("SELECT 1 FROM {runs} WHERE lock_name = 'batch-3' FOR UPDATE")
        )
        finished = threading.Event()
        results: list[retention.PruneResult] = []

        def run_prune() -> None:
            results.append(
                retention.prune(OnConnection(conn, db.tables), timedelta(days=7), batch=2)
            )
            finished.set()

        threading.Thread(target=run_prune, daemon=True).start()
        assert finished.wait(10), "prune waited for a row locked by another transaction"
    finally:
        claimant.close()

    assert 4 == results[0].deleted["runs"]
    assert ["batch-3"] == remaining(conn, db, "runs", "lock_name")


def test_prune_refuses_a_retention_below_the_minimum(db: Database, conn: Conn) -> None:
    """Pruning younger than an hour is refused: a redelivery could run its slot twice."""
    with pytest.raises(ConfigurationError, match="minimum"):
        retention.prune(OnConnection(conn, db.tables), timedelta(minutes=5))


def test_auto_prune_runs_at_most_once_per_interval(db: Database, conn: Conn) -> None:
    """AutoPrune prunes when due, then not again until its interval has passed."""
    now = [1000.0]
    pruner = retention.AutoPrune(db.settings, timedelta(days=7), every=3600, clock=lambda: now[0])
    add_run(conn, db, "first", "succeeded", 8)

    assert 1 == pruner.maybe_run().deleted["runs"]  # type: ignore[union-attr]
    add_run(conn, db, "second", "succeeded", 8)
    now[0] += 3599
    assert pruner.maybe_run() is None
    now[0] += 1
    assert 1 == pruner.maybe_run().deleted["runs"]  # type: ignore[union-attr]


def test_beat_leader_prunes_when_retention_is_set(
    db: Database, conn: Conn, pg_dsn: str, pglock_schema: str
) -> None:
    """With pglock_ledger_retention set, a beat tick prunes the ledger (of its namespace)."""
    add_run(conn, db, f"{pglock_schema}:stale", "succeeded", 10)
    app = Celery("prunebeat", set_as_current=False)
    app.conf.update(
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
        pglock_ledger_retention="7d",
        pglock_beat_leader=False,  # every replica ticks: no election needed for this test
        beat_schedule={},
    )
    scheduler = PgLockScheduler(app=app)
    try:
        scheduler.tick()
    finally:
        scheduler.close()
        close_all()  # the scheduler's per-process pool

    assert [] == remaining(conn, db, "runs", "lock_name")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [("7d", 604800), ("12h", 43200), ("90m", 5400), ("30s", 30), ("2w", 1209600), (3600, 3600)],
)
def test_durations_accept_units_and_seconds(value: Any, seconds: float) -> None:
    """Retention and --older-than accept s/m/h/d/w suffixes or plain seconds."""
    assert timedelta(seconds=seconds) == retention.parse_duration(value)


def test_retention_setting_rejects_nonsense() -> None:
    """A malformed pglock_ledger_retention fails naming the setting."""
    with pytest.raises(ConfigurationError, match="pglock_ledger_retention"):
        retention.retention_setting({"pglock_ledger_retention": "a week"})
    assert retention.retention_setting({}) is None


def test_since_takes_a_duration_or_an_iso_time() -> None:
    """--since 2h is two hours ago; an ISO time without zone is UTC."""
    now = datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc)

    assert datetime(2026, 11, 29, 10, 0, tzinfo=timezone.utc) == retention.parse_since("2h", now)
    assert datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc) == retention.parse_since(
        "2026-11-28T03:00:00", now
    )
    assert datetime(2026, 11, 28, 3, 0, tzinfo=timezone.utc) == retention.parse_since(
        "2026-11-28T03:00:00Z", now
    )
