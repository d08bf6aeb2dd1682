"""After start-up nothing exits on its own (guarantee 10): every path a beat tick or a task
takes meets a real outage here, one at a time, and the process goes on.

A ``PgLockScheduler`` runs in the test process on a throwaway server that the test stops;
each tick makes one path the only one due (the others' next looks pushed out of reach), so
the error the tick meets comes from that path: starting the election, leading, the orphan
sweep, the waiting-slot sweep, re-sending unconfirmed claims, registering the entries'
tasks, the freshness look, pruning, the look at the stored entries' changes. The worker's
rogue check meets it the same way. A locked task meeting an outage is retried
(tests/faults/test_server_faults.py).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from celery_pglock import PgLockTask
from celery_pglock import _rogue as rogue
from celery_pglock._config import app_settings
from celery_pglock.beat import PgLockScheduler
from celery_pglock.store._database import close_all, database
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.faults

DEADLINE = 30.0
FAR = float("inf")
TIMERS = {  # a path of the leader's tick -> where the scheduler keeps its next look
    "orphan-sweep": ("_next_sweep",),
    "resend": ("_next_resend_check",),
    "register-tasks": ("_next_register",),
    "freshness": ("_freshness", "_next"),
    "pruning": ("_pruner", "next_at"),
    "stored-entries": ("_next_entry_check",),
}


def make_app(server: EmbeddedPostgres, *, leader: bool) -> Celery:
    app = Celery(f"paths{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        pglock_dsn=server.dsn,
        pglock_connect_timeout=1,
        pglock_beat_leader=leader,
        pglock_ledger_retention="7d",
        beat_schedule={
            "hourly": {
                "task": "paths.job",
                "schedule": 3600.0,
                "options": {"pglock_overdue_after": 60},
            }
        },
    )

    @app.task(base=PgLockTask, name="paths.job", shared=False)
    def job() -> None:
        """A locked task a beat entry sends."""

    return app


@pytest.fixture
def scheduler(private_pg: EmbeddedPostgres, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A started scheduler on the test's own server (leader mode when asked for)."""
    leader = bool(getattr(request, "param", False))
    found = PgLockScheduler(app=make_app(private_pg, leader=leader))
    try:
        yield found
    finally:
        found.close()
        close_all()


def tick_until(scheduler: Any, done: Any, message: str) -> None:
    def ticked() -> bool:
        scheduler.tick()
        return bool(done())

    wait_until(ticked, timeout=DEADLINE, interval=0.1, message=message)


def only_due(scheduler: Any, path: str) -> None:
    """Push every look of the leader's tick out of reach but ``path``'s."""
    for name, where in TIMERS.items():
        owner = scheduler
        for attribute in where[:-1]:
            owner = getattr(owner, attribute)
        setattr(owner, where[-1], 0.0 if name == path else FAR)


def recover(scheduler: Any, path: str, caplog: pytest.LogCaptureFixture) -> None:
    """Tick with ``path`` due until the replica reaches PostgreSQL again (pooled
    connections the restart broke are replaced on the way)."""

    def back() -> bool:
        only_due(scheduler, path)
        scheduler.tick()
        outage = "pglock_beat_db_unavailable" in actions(caplog)
        return not outage or "pglock_beat_db_back" in actions(caplog)

    wait_until(back, timeout=DEADLINE, interval=0.2, message="beat to reach PostgreSQL again")


def actions(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [getattr(record, "action", "") for record in caplog.records]


@pytest.mark.parametrize("scheduler", [True], indirect=True)
def test_a_first_tick_during_an_outage_waits_then_the_replica_leads(
    scheduler: Any, private_pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """Election start: a first tick with PostgreSQL stopped returns (a WARNING, no
    exception); once it answers the replica leads."""
    caplog.set_level(logging.INFO, "celery_pglock")
    private_pg.stop()

    slept = scheduler.tick()
    private_pg.start()
    tick_until(scheduler, lambda: scheduler.is_leader, "the replica to lead")

    assert slept <= 1.0
    assert "pglock_startup_waiting" in actions(caplog)
    assert "pglock_startup_db_ready" in actions(caplog)


@pytest.mark.parametrize("scheduler", [True], indirect=True)
def test_a_leader_that_loses_postgresql_stands_by_and_leads_again(
    scheduler: Any, private_pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """Leader loss: PostgreSQL stops under a leader; its ticks go on, it steps down, and
    leads again once the server is back."""
    tick_until(scheduler, lambda: scheduler.is_leader, "the replica to lead")
    caplog.set_level(logging.INFO, "celery_pglock")
    private_pg.stop("immediate")

    tick_until(scheduler, lambda: not scheduler.is_leader, "the leader to step down")
    private_pg.start()
    tick_until(scheduler, lambda: scheduler.is_leader, "the replica to lead again")

    assert "pglock_beat_leader_lost" in actions(caplog)
    assert "pglock_beat_leader_elected" in actions(caplog)


@pytest.mark.parametrize("path", TIMERS)
def test_each_path_of_a_tick_survives_an_outage(
    scheduler: Any, private_pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """Orphan sweep, re-sends, task registry, freshness, pruning, the stored entries'
    changes: with PostgreSQL stopped the tick that meets it returns, says so once, and the
    next ticks recover."""
    tick_until(scheduler, lambda: scheduler._leading, "the replica to send")
    private_pg.stop()
    only_due(scheduler, path)
    caplog.set_level(logging.INFO, "celery_pglock")

    slept = scheduler.tick()
    said = actions(caplog)
    private_pg.start()
    recover(scheduler, path, caplog)

    assert slept <= 1.0
    if path == "pruning":  # its own connection, its own line; the tick itself is fine
        assert ["pglock_ledger_prune_failed"] == [a for a in said if "fail" in a or "db_" in a]
    else:
        assert ["pglock_beat_db_unavailable"] == [a for a in said if "db_" in a]


def test_the_waiting_slot_sweep_survives_an_outage(
    scheduler: Any, private_pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """The waiting-slot sweep meets the outage itself: it waits on a lock the test holds
    on the waiting table (the orphan sweep before it passes) while the server crashes;
    the tick returns, says so once, and the next ones recover."""
    tick_until(scheduler, lambda: scheduler._leading, "the replica to send")
    only_due(scheduler, "orphan-sweep")
    tables = scheduler.pglock_tables
    caplog.set_level(logging.INFO, "celery_pglock")
    blocker = psycopg.connect(private_pg.dsn)
    lock = sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(tables.table("waiting"))
    blocker.execute(lock)
    returned: list[float] = []
    ticking = threading.Thread(target=lambda: returned.append(scheduler.tick()))
    ticking.start()
    wait_until(
        lambda: waits_on_a_lock(private_pg.dsn),
        timeout=DEADLINE,
        message="the sweep to wait on the waiting table",
    )

    private_pg.stop("immediate")
    ticking.join(DEADLINE)
    blocker.close()
    said = actions(caplog)
    private_pg.start()
    recover(scheduler, "orphan-sweep", caplog)

    assert 1 == len(returned)
    assert ["pglock_beat_db_unavailable"] == [a for a in said if "db_" in a]


def waits_on_a_lock(dsn: str) -> bool:
    query = """
        SELECT 1 FROM pg_stat_activity
         WHERE application_name LIKE 'celery-pglock%%' AND wait_event_type = 'Lock'
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchone() is not None


def test_the_rogue_check_survives_an_outage(
    private_pg: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker's rogue check (a slot-less message of a task beat sends) with PostgreSQL
    stopped: the message is still reported (WARNING), nothing raises."""
    app = make_app(private_pg, leader=False)
    job = app.tasks["paths.job"]
    settings = app_settings(app)
    db = database(settings)
    with db.connection() as conn:
        params = {"namespace": app.main, "tasks": ["paths.job"], "entries": ["hourly"]}
        conn.execute(db.tables.query("beat_register_tasks"), params)
    watch = rogue.RogueWatch()
    job.push_request(origin="stock-beat@host", headers={})
    try:
        watch.slotless(job, app.main, lambda: db, locked=True)  # learns what beat sends
        watch._reported.clear()
        watch._next_refresh = 0.0  # a look-up due during the outage
        private_pg.stop()
        caplog.clear()
        watch.slotless(job, app.main, lambda: db, locked=True)
    finally:
        job.pop_request()
        close_all()

    assert ["pglock_rogue_scheduler"] == [action for action in actions(caplog) if action]
