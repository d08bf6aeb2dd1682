"""The lock outside Celery (``advisory_lock``, ``@run_once``) with processes racing for real.

Every lock is named after the test's schema: advisory locks are database-wide, and other
tests run at the same time. Racing processes are released together by a ``go`` file once
each has connected, so they contend for the lock rather than for the interpreter start.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock import (
    ConfigurationError,
    DatabaseUnavailable,
    LockLost,
    StaleToken,
    advisory_lock,
    fence,
    run_once,
)
from celery_pglock._config import Settings
from celery_pglock._ledger import FAILED, SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease
from celery_pglock._standalone import LockHandle
from celery_pglock.schema import Tables
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import close_all
from tests.fixtures.procs import Proc, Procs, wait_until
from tests.integration.locking import Conn, claim, lock_waiters, open_database, skipped

pytestmark = pytest.mark.integration

SLOT = "2026-11-29"
PASSWORD = "Sup3rS3cretPw"  # noqa: S105 - fake; must never be printed

# argv: dsn schema name slot seconds. Holds the lock for `seconds`, then releases it.
HOLDER_CODE = """
import sys, time
from celery_pglock import advisory_lock
dsn, schema, name, slot, seconds = sys.argv[1:6]
with advisory_lock(name, dsn=dsn, schema=schema, slot=slot or None) as lock:
    assert lock.acquired, lock.skip
    print("HELD", lock.token, flush=True)
    time.sleep(float(seconds))
print("RELEASED", flush=True)
"""

# argv: dsn schema name slot out go. Connects, waits for `go`, then races run_once.
RUN_ONCE_RACER = """
import os, sys, time
from pathlib import Path
from celery_pglock import run_once
from celery_pglock.store._database import database
from celery_pglock._standalone import LockOptions
dsn, schema, name, slot, out, go = sys.argv[1:7]
database(LockOptions(dsn=dsn, schema=schema).settings())

@run_once(name, slot=slot, dsn=dsn, schema=schema)
def job():
    with open(out, "a") as ran:
        ran.write(f"{os.getpid()}\\n")
    time.sleep(0.3)
    return "ran"

print("READY", flush=True)
while not Path(go).exists():
    time.sleep(0.005)
print("RESULT", job(), flush=True)
"""

# argv: dsn schema name scope out go. Waits for the lock; logs "token start end" of its turn.
WAITING_RACER = """
import sys, time
from pathlib import Path
from celery_pglock import advisory_lock
from celery_pglock.store._database import database
from celery_pglock._standalone import LockOptions
dsn, schema, name, scope, out, go = sys.argv[1:7]
database(LockOptions(dsn=dsn, schema=schema).settings())
print("READY", flush=True)
while not Path(go).exists():
    time.sleep(0.005)
with advisory_lock(name, dsn=dsn, schema=schema, scope=scope, wait=True, timeout=20) as lock:
    start = time.monotonic()
    time.sleep(0.15)
    end = time.monotonic()
with open(out, "a") as turns:
    turns.write(f"{lock.token} {start} {end}\\n")
"""


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    """The library's per-process pools opened by a test are closed after it."""
    yield
    close_all()


@pytest.fixture
def where(pg_dsn: str, pglock_schema: str) -> dict[str, Any]:
    """The keyword arguments that point the library at this test's schema."""
    return {"dsn": pg_dsn, "schema": pglock_schema}


@pytest.fixture
def job(pglock_schema: str) -> str:
    """A lock name of this test only."""
    return f"{pglock_schema}:job"


def start_holder(
    procs: Procs, dsn: str, schema: str, name: str, *, slot: str = "", seconds: float = 60
) -> Proc:
    """A process holding lock ``name`` (via ``advisory_lock``) for ``seconds``."""
    proc = procs.python("-c", HOLDER_CODE, dsn, schema, name, slot, str(seconds), name="holder")
    proc.wait_for_log("HELD", timeout=20)
    return proc


def race(procs: Procs, code: str, args: list[str], count: int, go: Path) -> list[Proc]:
    """Start ``count`` processes, wait until each is connected, then let them all go."""
    racers = [procs.python("-c", code, *args, name=f"racer{i}") for i in range(count)]
    for racer in racers:
        racer.wait_for_log("READY", timeout=20)
    go.touch()
    for racer in racers:
        assert 0 == racer.wait(timeout=20), racer.log_tail()
    return racers


def the_run(conn: Conn, schema: str, name: str, slot: str) -> dict[str, Any]:
    """The ledger row of (``name``, ``slot``) in ``schema``."""
    query = Tables(schema).render("SELECT * FROM {runs} WHERE lock_name = %s AND slot = %s")
    with conn.cursor(row_factory=dict_row) as cur:
        row = cur.execute(query, (name, slot)).fetchone()
    assert row is not None, f"no ledger row for ({name!r}, {slot!r})"
    return row


def skip_reasons(conn: Conn, schema: str, name: str) -> list[str]:
    """The reasons in the skip log of ``name``, oldest first."""
    query = Tables(schema).render("SELECT reason FROM {skips} WHERE lock_name = %s ORDER BY id")
    return [row[0] for row in conn.execute(query, (name,)).fetchall()]


def make_table(conn: Conn, schema: str) -> sql.Composed:
    """A table ``items`` in the test schema; the SQL that counts its rows."""
    table = sql.Identifier(schema, "items")
    conn.execute(sql.SQL("CREATE TABLE {} (v int)").format(table))
    return sql.SQL("SELECT count(*) FROM {}").format(table)


def count(conn: Conn, query: sql.Composed) -> int:
    row = conn.execute(query).fetchone()
    assert row is not None
    return int(row[0])


def insert_item(handle: LockHandle, schema: str) -> None:
    table = sql.Identifier(schema, "items")
    handle.connection.execute(sql.SQL("INSERT INTO {} VALUES (1)").format(table))


# -- racing processes ----------------------------------------------------------------------


def test_racing_processes_run_a_slot_once(
    procs: Procs, pg_conn: Conn, tmp_path: Path, where: dict[str, Any], job: str
) -> None:
    """Six processes race run_once on one slot: one body runs, the others skip and say why."""
    out, go = tmp_path / "ran", tmp_path / "go"
    pglock_schema = where["schema"]
    args = [where["dsn"], pglock_schema, job, SLOT, str(out), str(go)]

    racers = race(procs, RUN_ONCE_RACER, args, 6, go)

    runners = out.read_text().split()
    assert 1 == len(runners)
    results = sorted(line for r in racers for line in r.log_text().split("\n") if "RESULT" in line)
    assert ["RESULT None"] * 5 + ["RESULT ran"] == results
    run = the_run(pg_conn, pglock_schema, job, SLOT)
    assert (SUCCEEDED, 1, int(runners[0])) == (run["state"], run["attempts"], run["pid"])
    reasons = skip_reasons(pg_conn, pglock_schema, job)
    assert 5 == len(reasons)
    assert set(reasons) <= {"locked", "done"}


@pytest.mark.parametrize("scope", ["session", "transaction"])
def test_waiting_processes_take_turns_with_growing_tokens(
    procs: Procs, tmp_path: Path, where: dict[str, Any], job: str, scope: str
) -> None:
    """Four processes wait for one lock: their turns never overlap and tokens grow."""
    out, go = tmp_path / "turns", tmp_path / "go"
    args = [where["dsn"], where["schema"], job, scope, str(out), str(go)]

    race(procs, WAITING_RACER, args, 4, go)

    turns = sorted(
        (float(start), float(end), int(token))
        for token, start, end in (line.split() for line in out.read_text().splitlines())
    )
    assert 4 == len(turns)
    for before, after in itertools.pairwise(turns):
        assert after[0] >= before[1], f"turns overlap: {before} {after}"
        assert after[2] > before[2], f"token did not grow: {before} {after}"


def test_run_once_skips_while_another_process_holds_the_lock(
    procs: Procs, where: dict[str, Any], job: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The function is not called; the INFO log line names the reason and the holder."""
    holder = start_holder(procs, where["dsn"], where["schema"], job)
    calls: list[int] = []

    @run_once(job, **where)
    def work() -> int:
        calls.append(1)
        return 1

    with caplog.at_level(logging.INFO, logger="celery_pglock"):
        result = work()

    assert (None, []) == (result, calls)
    [record] = [r for r in caplog.records if getattr(r, "action", "") == "pglock_run_skipped"]
    assert ("locked", holder.pid, HOSTNAME) == (
        record.reason,  # type: ignore[attr-defined]
        record.holder["pid"],  # type: ignore[attr-defined]
        record.holder["host"],  # type: ignore[attr-defined]
    )
    assert f"pid {holder.pid}" in record.getMessage()


# -- the ledger ------------------------------------------------------------------------------


def test_succeeded_slot_is_skipped_as_done(where: dict[str, Any], job: str) -> None:
    """A second use of a slot that succeeded is not acquired: reason done, who ran it."""
    with advisory_lock(job, slot=SLOT, **where) as first:
        assert first.acquired

    with advisory_lock(job, slot=SLOT, **where) as second:
        pass

    assert (False, "done", None) == (second.acquired, second.reason, second.token)
    assert second.holder is not None
    assert (os.getpid(), HOSTNAME) == (second.holder["pid"], second.holder["host"])


def test_sys_exit_zero_in_the_block_counts_as_success(
    pg_conn: Conn, where: dict[str, Any], job: str
) -> None:
    """sys.exit(0) inside the block (a management command's way out) records succeeded."""

    def command() -> None:
        with advisory_lock(job, slot=SLOT, **where):
            sys.exit(0)

    with pytest.raises(SystemExit):
        command()

    assert SUCCEEDED == the_run(pg_conn, where["schema"], job, SLOT)["state"]


def test_failure_is_recorded_and_the_retry_runs_with_a_larger_token(
    pg_conn: Conn, where: dict[str, Any], job: str
) -> None:
    """A raising body records failed; the next call runs again, then the slot is done."""
    tokens: list[int] = []

    @run_once(job, slot=SLOT, bind=True, **where)
    def flaky(lock: LockHandle) -> str:
        assert lock.token is not None
        tokens.append(lock.token)
        if len(tokens) == 1:
            raise RuntimeError("boom")
        return "ok"

    with pytest.raises(RuntimeError, match="boom"):
        flaky()
    failed = the_run(pg_conn, where["schema"], job, SLOT)
    results = [flaky(), flaky()]

    assert (FAILED, "RuntimeError: boom") == (failed["state"], failed["reason"])
    assert ["ok", None] == results
    assert 2 == len(tokens)
    assert tokens[1] > tokens[0]
    run = the_run(pg_conn, where["schema"], job, SLOT)
    assert (SUCCEEDED, 2, tokens[1]) == (run["state"], run["attempts"], run["token"])


def test_name_and_slot_functions_receive_the_arguments(
    pg_conn: Conn, where: dict[str, Any], pglock_schema: str
) -> None:
    """name and slot callables get the function's arguments; the ledger row carries both."""

    @run_once(lambda account, day: f"{pglock_schema}:{account}", slot=lambda _, day: day, **where)
    def close_books(account: str, day: str) -> str:
        return f"{account}@{day}"

    assert "acme@2026-11-28" == close_books("acme", "2026-11-28")
    assert None is close_books("acme", "2026-11-28")
    assert "acme@2026-11-29" == close_books("acme", day="2026-11-29")
    run = the_run(pg_conn, pglock_schema, f"{pglock_schema}:acme", "2026-11-29")
    assert SUCCEEDED == run["state"]
    assert run["task_name"].endswith("close_books")


def test_same_keys_ledger_and_tokens_as_tasks(
    pg_dsn: str, where: dict[str, Any], pglock_schema: str, job: str
) -> None:
    """A task's claim on the lock name is skipped while held, then sees the slot done;
    tokens come from one sequence, so fence() rejects the older holder."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema)
    with open_database(settings) as db:
        with advisory_lock(job, slot=SLOT, **where) as lock:
            while_held = skipped(acquire(db, claim(job, SLOT), "session", None))
            assert lock.token is not None
            fence(lock.connection, "report", lock.token, tables=lock.tables)
        after = skipped(acquire(db, claim(job, SLOT), "session", None))
        task = acquire(db, claim(job), "session", None)
        assert isinstance(task, Lease)
        fence(task.connection, "report", task.token, tables=lock.tables)
        release(db, task, SUCCEEDED)

        # The task's release of a lock without a slot is sent without waiting for its
        # reply: on a loaded machine the server may not have run it yet. Waiting (5 s at
        # most) is not what this test is about; the fence is.
        with (
            advisory_lock(job, wait=True, timeout=5, **where) as stale,
            pytest.raises(StaleToken),
        ):
            fence(stale.connection, "report", lock.token, tables=lock.tables)

    assert ("locked", os.getpid()) == (while_held.reason, (while_held.holder or {})["pid"])
    assert "done" == after.reason
    assert task.token > lock.token


# -- transaction scope ---------------------------------------------------------------------


def test_transaction_scope_commits_with_the_lock(
    pg_conn: Conn, where: dict[str, Any], pglock_schema: str, job: str
) -> None:
    """The block's writes and the ledger row commit together when the block ends."""
    items = make_table(pg_conn, pglock_schema)

    with advisory_lock(job, scope="transaction", slot=SLOT, **where) as lock:
        insert_item(lock, pglock_schema)
        seen_inside = count(pg_conn, items)
        with advisory_lock(job, **where) as rival:
            pass

    assert (0, 1) == (seen_inside, count(pg_conn, items))
    assert ("locked", os.getpid()) == (rival.reason, (rival.holder or {}).get("pid"))
    assert SUCCEEDED == the_run(pg_conn, pglock_schema, job, SLOT)["state"]


def test_transaction_scope_rolls_back_on_exception(
    pg_conn: Conn, where: dict[str, Any], pglock_schema: str, job: str
) -> None:
    """A raising block leaves no write behind, and the attempt is recorded as failed."""
    items = make_table(pg_conn, pglock_schema)

    def write_then_fail() -> None:
        with advisory_lock(job, scope="transaction", slot=SLOT, **where) as lock:
            insert_item(lock, pglock_schema)
            raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        write_then_fail()

    assert 0 == count(pg_conn, items)
    run = the_run(pg_conn, pglock_schema, job, SLOT)
    assert (FAILED, "ValueError: bad") == (run["state"], run["reason"])


def test_lost_transaction_lock_raises_on_exit(
    pg_conn: Conn, where: dict[str, Any], job: str
) -> None:
    """When the server ends the lock's session, check() and the end of the block raise."""
    checked: list[LockLost] = []

    def lose_the_lock() -> None:
        with advisory_lock(job, scope="transaction", lease=0.6, **where) as lock:
            pg_conn.execute("SELECT pg_terminate_backend(%s)", (lock.connection.info.backend_pid,))
            wait_until(lambda: lock.lost, timeout=5, message="the heartbeat to notice")
            try:
                lock.check()
            except LockLost as exc:
                checked.append(exc)

    with pytest.raises(LockLost, match="rolled back"):
        lose_the_lock()
    assert 1 == len(checked)


# -- waiting -------------------------------------------------------------------------------


def test_wait_times_out_with_a_skip_naming_the_holder(
    procs: Procs, where: dict[str, Any], job: str
) -> None:
    """wait=True with a timeout gives up after it; the skip says who holds the lock."""
    holder = start_holder(procs, where["dsn"], where["schema"], job)

    started = time.monotonic()
    with advisory_lock(job, wait=True, timeout=0.5, **where) as lock:
        waited = time.monotonic() - started

    # The holder keeps the lock for a minute: a wait that ended without it was its timeout.
    assert (False, "locked", holder.pid) == (lock.acquired, lock.reason, (lock.holder or {})["pid"])
    assert waited >= 0.5
    assert holder.alive


def test_wait_is_granted_the_moment_the_holder_dies(
    procs: Procs, where: dict[str, Any], job: str
) -> None:
    """A waiter queues in the server's lock queue, not polling, and is granted the lock by
    the SIGKILLed holder's session ending, long before the holder would have let go. How
    soon after the kill is a figure: ``python -m benchmarks.handover`` (docs/benchmarks.md
    §14), not asserted here."""
    holder = start_holder(procs, where["dsn"], where["schema"], job)
    queued: list[int] = []

    def kill_once_queued() -> None:
        with psycopg.connect(where["dsn"], autocommit=True) as conn:
            queued.extend(
                wait_until(
                    lambda: lock_waiters(conn, job),
                    timeout=20,
                    message="the waiter in the server's lock queue",
                )
            )
        holder.kill()

    killer = threading.Thread(target=kill_once_queued)
    killer.start()
    with advisory_lock(job, wait=True, timeout=30, **where) as lock:
        killer.join()

    assert lock.acquired
    assert 1 == len(queued)  # one backend waiting on the lock, in the server
    assert -signal.SIGKILL == holder.wait(timeout=20)  # the kill, not its minute, freed it


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"scope": "global"}, "scope must be"),
        ({"timeout": 5}, "needs wait=True"),
        ({"lease": -1}, "lease must be"),
    ],
)
def test_bad_options_fail_when_decorating(options: dict[str, Any], message: str) -> None:
    """An invalid option is a ConfigurationError at decoration time, not at the first run."""
    with pytest.raises(ConfigurationError, match=message):
        run_once("job", dsn="postgresql://app@db/app", **options)


def test_a_slot_that_is_not_a_string_is_refused(where: dict[str, Any], job: str) -> None:
    """A slot function returning a non-str fails clearly, before anything is locked."""

    @run_once(job, slot=lambda day: day, **where)
    def daily(day: object) -> None:
        raise AssertionError("must not run")

    with pytest.raises(ConfigurationError, match="slot must be a str"):
        daily(20261129)


def test_missing_dsn_names_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a DSN argument, PGLOCK_DSN or DATABASE_URL the error says what to set."""
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    # Nor a Django project's database: an earlier test may have configured Django here.
    monkeypatch.setitem(sys.modules, "django.conf", None)

    with pytest.raises(ConfigurationError, match="PGLOCK_DSN"), advisory_lock("job"):
        pass


def test_unreachable_database_never_shows_the_password() -> None:
    """DatabaseUnavailable names the server, not the password."""
    dsn = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"

    with pytest.raises(DatabaseUnavailable) as raised, advisory_lock("job", dsn=dsn):
        pass

    assert PASSWORD not in str(raised.value)
    assert "127.0.0.1" in str(raised.value)


def test_dsn_comes_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, pg_dsn: str, pglock_schema: str, job: str
) -> None:
    """Without a dsn argument, PGLOCK_DSN is used."""
    monkeypatch.setenv("PGLOCK_DSN", pg_dsn)

    with advisory_lock(job, schema=pglock_schema) as lock:
        assert lock.acquired
        assert isinstance(lock.connection, psycopg.Connection)


def test_transaction_scope_run_whose_connection_died_is_recorded_failed(
    where: dict[str, Any], job: str, pg_conn: Conn
) -> None:
    """D1 outside Celery: a transaction-scope ``run_once`` whose lock connection dies
    during the body (the server ended the session) records the attempt ``failed``, as a
    task does, instead of leaving the slot's row as it was."""

    @run_once(job, slot=SLOT, scope="transaction", bind=True, **where)
    def body(handle: LockHandle) -> None:
        backend = handle.connection.info.backend_pid
        pg_conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
        handle.connection.execute("SELECT 1")  # the session is gone: OperationalError

    with pytest.raises(psycopg.OperationalError):
        body()

    run = the_run(pg_conn, where["schema"], job, SLOT)
    assert (FAILED, 1) == (run["state"], run["attempts"])
    assert "terminating connection" in run["reason"]


def test_session_scope_run_whose_connection_died_is_recorded_failed(
    where: dict[str, Any], job: str, pg_conn: Conn
) -> None:
    """The same fault in session scope: the body's error is recorded on a fresh
    connection, since no newer attempt took the slot over."""

    @run_once(job, slot=SLOT, bind=True, **where)
    def body(handle: LockHandle) -> None:
        pg_conn.execute("SELECT pg_terminate_backend(%s)", (handle.connection.info.backend_pid,))
        raise RuntimeError("the work failed")

    with pytest.raises(RuntimeError):
        body()

    run = the_run(pg_conn, where["schema"], job, SLOT)
    assert (FAILED, "RuntimeError: the work failed") == (run["state"], run["reason"])
