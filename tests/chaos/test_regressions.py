"""Defects the chaos campaign found, each pinned by a targeted test that needs no luck.

- D1, seed 101 (and seeds 3, 202, 303, 4242…): a transaction-scope run whose lock connection
  died during its body (PostgreSQL restarted, PgBouncer's server connection crashed) was
  never recorded: ``_pglock_fail`` rolls back on the dead connection, which raises, so
  ``record_failure_after_rollback`` never runs. The beat's ``scheduled`` row stayed
  ``scheduled`` although its message ended ``FAILURE`` (guarantee 8: every ledger row
  reaches a final state; docs/guarantees.md: a body that raises leaves the row ``failed``).
  Fixed: the failure is recorded on a fresh connection.
- D2, seeds 404 and 505 (active-active): two beat replicas claiming the same slots
  deadlock. Celery's ``Scheduler.merge_inplace`` fills the schedule from
  ``set(beat_schedule)``, so each process (its own ``PYTHONHASHSEED``) holds the entries in
  another order, and ``PgLockSchedulerMixin._claim`` inserts the due (entry, slot) claims in
  that order; PostgreSQL ends the deadlock after ``deadlock_timeout`` (1 s): one replica's
  claim fails ("beat cannot reach PostgreSQL … deadlock detected"), the other's slots go
  out a second late and collide with the next slot (skipped ``locked``/``superseded``).
  The test makes the race certain: two replicas whose hash seeds give opposite orders,
  and a trigger (test scaffolding) that makes every claimed row take 0.3 s. Fixed: every
  replica claims (and confirms) in (entry, slot) order.
- D3, the rest of D1: a transaction-scope run whose lock connection dies after its body
  returned, before the commit, is not recorded either: the release fails on the dead
  connection and ``locks._recover_outcome`` returns at once for transaction scope ("the
  outcome rolled back with the body"), so the task fails with ``LockLost`` and the slot's
  row stays as it was (``scheduled``, or none). Rare in a campaign (the window is the
  release's round trip), certain here: the body writes, then waits while the test ends its
  session, then returns. Fixed: the attempt is recorded failed on a fresh connection.
- D4, seed 505 after the fix of D1: behind PgBouncer's transaction pooling the same run
  is still not recorded when its body failed for another reason after the server
  restarted: the rollback on the lock's connection reads PgBouncer's buffered error and
  its own, and psycopg raises ``InternalError("received 2 results from command
  'ROLLBACK'")``, not the ``OperationalError`` that ``locks.record_transaction_failure``
  catches. Certain here: the body waits while the server restarts, then raises without a
  statement. Fixed: any error that leaves the connection closed or broken is handled alike.
- D8, issue 24 (random mixed faults, as a user tried them): a beat replica restarted 1.6 s
  after it was killed landed in a one-second PostgreSQL restart; its first tick starts the
  leader election outside the guard of every later tick, so it logged ``beat raised
  exception DatabaseUnavailable`` with a traceback and exited 1; a worker started during
  an outage exits from its start-up check (``Unrecoverable error: DatabaseUnavailable``).
  The campaign restarted such a process and counted it ("failed to start"). Seed 38 (30 s)
  restarts beat b1 0.6 s before a fast PostgreSQL restart: its election connected 0.05 s
  before the next restart, one tick short of the failure. Certain here: PostgreSQL is
  stopped while a beat replica and a worker start, and started once both have tried.
  Fixed: both wait for PostgreSQL (``startup``), beat's first ticks included.
- D9, seed 7 (60 s) once (f) judged the ``buffered`` entry too: its slots stopped running
  for good. A ``buffer_one`` message got its lock, then forgetting its slot's waiting row
  met a dead pooled connection (a terminated backend): the raw ``AdminShutdown`` escaped
  the task ("raised unexpected") and the granted lock was never given back; its
  heartbeat kept the session, and so the lock, alive. Every later slot waited behind it.
  Certain here: a trigger ends the session that forgets the waiting row. Fixed: the
  waiting statements' errors are a ``DatabaseUnavailable`` (``Database.connection``), and
  the granted lock is given back (recorded failed) before the message is retried.
- D11, seed 2612 (issue 35, every process behind PgBouncer's transaction pooling): a
  worker failed to start, ``prepared statement "_pg3_1" does not exist``. Its start-up
  connection runs one statement more than five times (the pooler check, a migration), so
  psycopg prepared it on one server connection; with other processes starting through
  the pooler at once, the next run of it landed on another server connection. Prepared
  statements were turned off only on the pool's connections, once the pooler was known.
  Certain here: another client takes the server connection in between. Fixed: a one-off
  connection prepares nothing (the beat leader's session, never pooled, still does).
"""

from __future__ import annotations

import subprocess
import sys
from functools import partial

import psycopg
import pytest
from psycopg import sql

from celery_pglock._config import Settings
from celery_pglock._keys import lock_key, split_key
from celery_pglock.schema import Tables, statement
from celery_pglock.store._connections import connect
from celery_pglock.store._migrations import ensure_schema
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import testapp
from tests.chaos import chaosapp
from tests.faults import pgbouncer
from tests.faults.workload import READY_TIMEOUT, Sent, Workload
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.chaos

SLOT = "2026-11-29T18:05:00Z"
DEADLINE = 30.0
PREPARED_AFTER = 5  # psycopg's prepare_threshold: a statement run this often is prepared


def holder_backend(dsn: str, lock: str) -> int | None:
    """The backend that holds advisory lock ``lock`` now, if any."""
    classid, objid = split_key(lock_key(lock))
    query = """
        SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
           AND classid = %s::bigint::oid AND objid = %s::bigint::oid
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, (classid, objid)).fetchone()
    return int(row[0]) if row else None


def test_transaction_scope_run_whose_connection_died_is_recorded_failed(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A transaction-scope run whose session is ended mid-body leaves its slot `failed`."""
    w = Workload(
        name="txlost",
        admin_dsn=private_pg.dsn,
        app_dsn=private_pg.dsn,
        redis_url=redis_url,
        procs=procs,
    )
    w.prepare()
    w.worker("tx", concurrency=1)
    gate, key = w.gate(), w.key("tx")
    [sent] = w.send(key, slot=SLOT, task="faults.job_tx", gate=str(gate))
    backend = wait_until(
        lambda: holder_backend(private_pg.dsn, sent.lock),
        timeout=DEADLINE,
        message="the run to hold its lock",
    )
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    gate.touch()
    w.settle([sent])
    rows = [(r["slot"], r["state"]) for r in w.ledger() if r["lock_name"] == sent.lock]
    assert "FAILURE" == sent.result.state
    assert [(SLOT, "failed")] == rows


SLOW_CLAIMS = """
CREATE FUNCTION {schema}.slow_claim() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$;
CREATE TRIGGER slow_claim BEFORE INSERT ON {table} FOR EACH ROW
    EXECUTE FUNCTION {schema}.slow_claim();
"""
TICKS = 4  # slots of the 1-s entries claimed by both replicas


def entry_order(hash_seed: int, names: list[str]) -> list[str]:
    """The order ``merge_inplace`` gives ``names`` in a process with this hash seed."""
    code = f"print(','.join(set({names!r})))"
    env = {"PYTHONHASHSEED": str(hash_seed)}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return done.stdout.strip().split(",")


def opposite_hash_seeds(names: list[str]) -> tuple[int, int]:
    """Two hash seeds under which the 1-s entries come in opposite orders."""
    pair = [name for name in names if chaosapp.ENTRIES[name][1] == 1.0]
    orders: dict[tuple[str, ...], int] = {}
    for seed in range(32):
        order = tuple(n for n in entry_order(seed, names) if n in pair)
        orders.setdefault(order, seed)
        if len(orders) == 2:
            first, second = orders.values()
            return first, second
    raise AssertionError(f"no two hash seeds order {pair} differently")


def test_active_active_replicas_claiming_the_same_slots_never_deadlock(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """Two active-active replicas whose schedules list the entries in opposite orders
    claim the same slots without a deadlock."""
    w = Workload(
        name="claims",
        admin_dsn=private_pg.dsn,
        app_dsn=private_pg.dsn,
        redis_url=redis_url,
        procs=procs,
        app="tests.chaos.chaosapp",
        TEST_BEAT_LEADER="0",
    )
    w.prepare()
    tables = Tables(w.schema, "pglock_")
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        ensure_schema(conn, tables, auto_migrate=True)
        conn.execute(
            sql.SQL(SLOW_CLAIMS).format(
                schema=sql.Identifier(w.schema),
                table=sql.Identifier(w.schema, "pglock_beat_sends"),
            )
        )
    names = [name for name in chaosapp.ENTRIES if name != "tx"]
    for label, hash_seed in zip("ab", opposite_hash_seeds(names), strict=True):
        w.beat(label, lead=None, PYTHONHASHSEED=str(hash_seed))

    def claimed() -> bool:
        w.alive_check()
        return sum(1 for row in w.beat_sends() if row["entry"] == "short") >= TICKS

    w.wait_for(claimed, timeout=DEADLINE, message=f"{TICKS} slots claimed")
    assert [] == [line for line in w.logs().splitlines() if "deadlock detected" in line]


def in_transaction(dsn: str, backend: int) -> bool:
    """Whether ``backend`` sits idle inside a transaction (the body wrote, now waits)."""
    query = "SELECT state FROM pg_stat_activity WHERE pid = %s"
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, (backend,)).fetchone()
    return row is not None and row[0] == "idle in transaction"


def backend_gone(dsn: str, backend: int) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (backend,))
        return row.fetchone() is None


def test_transaction_scope_run_whose_connection_died_before_commit_is_recorded_failed(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A transaction-scope run whose session ends between its body and its commit leaves
    its slot `failed`."""
    w = Workload(
        name="txcommit",
        admin_dsn=private_pg.dsn,
        app_dsn=private_pg.dsn,
        redis_url=redis_url,
        procs=procs,
    )
    w.prepare()
    w.worker("tx", concurrency=1)
    gate, key = w.gate(), w.key("tx")
    [sent] = w.send(key, slot=SLOT, task="faults.job_tx", gate=str(gate), via="first")
    backend = wait_until(
        lambda: holder_backend(private_pg.dsn, sent.lock),
        timeout=DEADLINE,
        message="the run to hold its lock",
    )
    wait_until(
        lambda: in_transaction(private_pg.dsn, backend),
        timeout=DEADLINE,
        message="the body to have written and to wait",
    )
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_terminate_backend(%s)", (backend,))
    wait_until(
        lambda: backend_gone(private_pg.dsn, backend),
        timeout=DEADLINE,
        message="the session to end",
    )
    gate.touch()
    w.settle([sent])
    rows = [(r["slot"], r["state"]) for r in w.ledger() if r["lock_name"] == sent.lock]
    assert ("FAILURE", "LockLost") == (sent.result.state, type(sent.result.result).__name__)
    assert [(SLOT, "failed")] == rows


def test_transaction_scope_run_behind_pgbouncer_failing_after_a_restart_is_recorded_failed(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """Behind PgBouncer, a transaction-scope run that fails after its server restarted
    leaves its slot `failed`."""
    with pgbouncer.started(private_pg.dsn, procs.log_dir / "pgbouncer.log") as bouncer:
        w = Workload(
            name="txbouncer",
            admin_dsn=private_pg.dsn,
            app_dsn=bouncer.dsn_for("tx"),
            redis_url=redis_url,
            procs=procs,
        )
        w.prepare()
        w.worker("tx", concurrency=1)
        gate, key = w.gate(), w.key("tx")
        [sent] = w.send(key, slot=SLOT, task="faults.job_tx", gate=str(gate), via="fail")
        wait_until(
            lambda: holder_backend(private_pg.dsn, sent.lock),
            timeout=DEADLINE,
            message="the run to hold its lock",
        )
        private_pg.restart("fast")
        gate.touch()
        w.settle([sent])
        rows = [(r["slot"], r["state"]) for r in w.ledger() if r["lock_name"] == sent.lock]
    assert "FAILURE" == sent.result.state
    assert [(SLOT, "failed")] == rows


def tried_to_connect(proc: Proc) -> bool:
    """Whether a process started during the outage has met it: it waits, or it exited."""
    return not proc.alive or "PostgreSQL" in proc.log_text()


def test_a_beat_and_a_worker_started_while_postgresql_is_down_come_up_once_it_answers(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A beat replica and a worker started while PostgreSQL is down wait for it; once it
    answers the replica leads and a beat slot runs, and neither process exited."""
    w = Workload(
        name="startup",
        admin_dsn=private_pg.dsn,
        app_dsn=private_pg.dsn,
        redis_url=redis_url,
        procs=procs,
    )
    w.prepare()
    private_pg.stop("immediate")
    beat, worker = w.beat("b", lead=None), w.worker("w", wait=False)
    for proc in (beat, worker):
        wait_until(partial(tried_to_connect, proc), timeout=READY_TIMEOUT, message="an attempt")
    private_pg.start()

    w.wait_for(lambda: w.worker_ready(worker), timeout=READY_TIMEOUT, message="worker ready")
    w.wait_for(
        lambda: any(r["finished"] for r in w.executions("faults.periodic")),
        timeout=READY_TIMEOUT,
        message="a beat slot to run",
    )
    assert (True, True) == (beat.alive, worker.alive)


FORGET_DIES = """
CREATE FUNCTION {schema}.forget_dies() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_terminate_backend(pg_backend_pid()); RETURN NULL; END $$;
CREATE TRIGGER forget_dies BEFORE DELETE ON {table}
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.forget_dies();
"""


def test_a_buffer_one_run_whose_waiting_row_cannot_be_forgotten_gives_its_lock_back(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A buffer_one message granted its lock, whose session forgetting the slot's waiting
    row is ended: the lock is given back and the message retried; once the sessions live
    again, its retry runs the slot, which succeeds (2 attempts), and no lock is left."""
    w = Workload(
        name="d9",
        admin_dsn=private_pg.dsn,
        app_dsn=private_pg.dsn,
        redis_url=redis_url,
        procs=procs,
    )
    w.prepare()
    tables = Tables(w.schema, "pglock_")
    trigger = sql.SQL(FORGET_DIES).format(
        schema=sql.Identifier(w.schema), table=sql.Identifier(w.schema, "pglock_waiting")
    )
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        ensure_schema(conn, tables, auto_migrate=True)
        conn.execute(trigger)
    w.worker("w", concurrency=1)
    sent = testapp.app.send_task("testapp.buffered_tick", headers={"pglock_slot": SLOT})
    lock = f"{w.namespace}:testapp.buffered_tick"

    def attempted() -> bool:
        return sent.state != "PENDING" or bool(w.executions())

    w.wait_for(attempted, timeout=DEADLINE, message="the first attempt")
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TRIGGER forget_dies ON {}").format(tables.table("waiting")))
    w.settle([Sent(sent, lock, SLOT)])
    [row] = [r for r in w.ledger() if r["lock_name"] == lock]

    assert ("SUCCESS", "succeeded", 2) == (sent.state, row["state"], row["attempts"])
    assert None is holder_backend(private_pg.dsn, lock)


def test_a_start_up_connection_behind_pgbouncer_never_prepares_a_statement(
    pg_dsn: str, procs: Procs
) -> None:
    """D11: a statement run on a one-off connection (start-up checks, the CLI) as often as
    the pooler check runs one still works when the pooler hands the next run to another
    server connection."""
    with pgbouncer.started(pg_dsn, procs.log_dir / "pgbouncer.log") as bouncer:
        settings = Settings(dsn=bouncer.dsn_for("tx"))
        with connect(settings) as conn:
            for _ in range(PREPARED_AFTER + 1):
                conn.execute(statement("show_setting"), {"name": "server_version"})
            # Another client takes the server connection this one just used (last in,
            # first out) and keeps it in its transaction: the next run goes elsewhere.
            with psycopg.connect(bouncer.dsn_for("tx")) as other:
                other.execute("SELECT 1")
                conn.execute(statement("show_setting"), {"name": "server_version"})
