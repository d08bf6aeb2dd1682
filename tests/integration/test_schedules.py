"""Schedule entries stored in PostgreSQL (``celery_pglock.schedules``) on a real server:
each change stored only once checked, numbered, audited with its before and after; and a
``PgLockScheduler`` (in this process, real PostgreSQL and Redis, the messages counted on
the queue) sends a stored entry from its next tick, in its new form once edited, and
nothing more once removed."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery
from psycopg import sql

from celery_pglock import schedules
from celery_pglock._slots import parse_slot
from celery_pglock.beat import PgLockScheduler
from celery_pglock.errors import ConfigurationError, UnknownEntry
from celery_pglock.schema import Tables
from celery_pglock.store._database import close_all
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.integration

TASK = "sched.report"


def report(**_: Any) -> None:
    """The task the entries send (never run here: the messages are counted on the queue)."""


@pytest.fixture
def app(pg_dsn: str, pglock_schema: str, redis_url: str) -> Iterator[Celery]:
    app = Celery(f"sched{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        task_default_queue=f"sched-{uuid.uuid4().hex[:8]}",
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=f"ns-{uuid.uuid4().hex[:6]}",
        pglock_beat_max_interval=1,
        beat_schedule={"code-entry": {"task": TASK, "schedule": 3600.0}},
    )
    app.task(name=TASK)(report)
    yield app
    app.close()
    close_all()


def audit(pg_dsn: str, schema: str, app: Celery) -> list[dict[str, Any]]:
    query = sql.SQL(
        "SELECT action, entry, actor, detail FROM {} WHERE namespace = %s ORDER BY id"
    ).format(Tables(schema).table("audit"))
    with psycopg.connect(pg_dsn, autocommit=True) as conn, conn.cursor() as cur:
        cur.execute(query, [app.conf.pglock_namespace])
        columns = [c.name for c in cur.description or []]
        return [dict(zip(columns, row, strict=True)) for row in cur.fetchall()]


def test_an_entry_is_stored_audited_and_listed(
    app: Celery, pg_dsn: str, pglock_schema: str
) -> None:
    made = schedules.add(
        app, "report", TASK, cron="0 8 * * mon", tz="Europe/Paris", kwargs={"to": "ops"}, by="ann"
    )

    assert ({"cron": "0 8 * * mon", "tz": "Europe/Paris"}, {"to": "ops"}) == (
        made.schedule,
        made.kwargs,
    )
    assert [made] == schedules.entries(app)
    assert made == schedules.get(app, "report")
    [row] = audit(pg_dsn, pglock_schema, app)
    assert ("entry_add", "report", "ann", None) == (
        row["action"],
        row["entry"],
        row["actor"],
        row["detail"]["before"],
    )
    assert "0 8 * * mon" == row["detail"]["after"]["schedule"]["cron"]


@pytest.mark.parametrize(
    ("given", "field"),
    [
        ({"cron": "0 25 * * *"}, "cron"),
        ({"cron": "0 8 * * *", "tz": "Europe/Atlantis"}, "tz"),
        ({"every": 0}, "every"),
        ({"every": 30, "args": "[1,"}, "args"),
        ({"every": 30, "kwargs": {"blob": "x" * 70_000}}, "at most"),
        ({"every": 30, "task": "sched.missing"}, "not a task of this app"),
        ({"at": "2020-01-01T00:00:00Z"}, "a time ahead"),
        ({"every": 30, "priority": 999}, "priority"),
    ],
)
def test_a_bad_entry_is_refused_naming_the_field_and_nothing_is_stored(
    app: Celery, pg_dsn: str, pglock_schema: str, given: dict[str, Any], field: str
) -> None:
    task = given.pop("task", TASK)
    with pytest.raises(ConfigurationError, match=field):
        schedules.add(app, "bad", task, **given)

    assert [] == schedules.entries(app)
    assert [] == audit(pg_dsn, pglock_schema, app)


def test_a_task_only_the_workers_import_is_taken_with_force(app: Celery) -> None:
    made = schedules.add(app, "elsewhere", "workers.only", every="5m", force=True)

    assert "workers.only" == made.task


def test_an_edit_changes_only_what_it_names_and_is_audited_before_and_after(
    app: Celery, pg_dsn: str, pglock_schema: str
) -> None:
    first = schedules.add(app, "report", TASK, every="2s", kwargs={"to": "ops"}, queue="reports")

    edited = schedules.update(app, "report", every="5s", by="bob")

    assert ({"every": 5.0}, {"to": "ops"}, {"queue": "reports"}) == (
        edited.schedule,
        edited.kwargs,
        edited.options,
    )
    assert edited.version > first.version
    row = audit(pg_dsn, pglock_schema, app)[-1]
    assert ("entry_edit", "bob") == (row["action"], row["actor"])
    assert (2.0, 5.0) == (
        row["detail"]["before"]["schedule"]["every"],
        row["detail"]["after"]["schedule"]["every"],
    )


def test_an_edit_of_the_timezone_keeps_the_cron_expression(app: Celery) -> None:
    schedules.add(app, "report", TASK, cron="0 8 * * *", tz="Europe/Paris")

    edited = schedules.update(app, "report", tz="Asia/Tokyo")

    assert {"cron": "0 8 * * *", "tz": "Asia/Tokyo"} == edited.schedule


def test_a_name_taken_or_missing_is_refused(app: Celery) -> None:
    schedules.add(app, "report", TASK, every=60)

    with pytest.raises(ConfigurationError, match="exists"):
        schedules.add(app, "report", TASK, every=30)
    with pytest.raises(ConfigurationError, match="no entry 'ghost'"):
        schedules.update(app, "ghost", every=30)
    with pytest.raises(UnknownEntry, match="no entry 'ghost'"):
        schedules.remove(app, "ghost")


def test_ensure_stores_once_and_changes_only_what_differs(
    app: Celery, pg_dsn: str, pglock_schema: str
) -> None:
    first = schedules.ensure(app, "nightly", TASK, every="1d")
    again = schedules.ensure(app, "nightly", TASK, every="1d")
    changed = schedules.ensure(app, "nightly", TASK, every="12h")

    assert first.version == again.version < changed.version
    assert ["entry_ensure", "entry_ensure"] == [
        r["action"] for r in audit(pg_dsn, pglock_schema, app)
    ]


def test_a_removed_entry_is_gone_and_audited_with_what_it_was(
    app: Celery, pg_dsn: str, pglock_schema: str
) -> None:
    added = schedules.add(app, "report", TASK, every=60)

    assert added == schedules.remove(app, "report", by="ann")  # what it was

    assert (None, []) == (schedules.get(app, "report"), schedules.entries(app))
    row = audit(pg_dsn, pglock_schema, app)[-1]
    assert ("entry_remove", None) == (row["action"], row["detail"]["after"])
    assert added.as_json() == row["detail"]["before"]
    assert schedules.add(app, "report", TASK, every=30).schedule == {"every": 30.0}


def test_two_edits_at_once_are_both_audited_and_the_last_one_wins(
    app: Celery, pg_dsn: str, pglock_schema: str
) -> None:
    schedules.add(app, "report", TASK, every=60)
    start = threading.Barrier(2)
    done: list[int] = []

    def edit(seconds: int) -> None:
        start.wait()
        done.append(int(schedules.update(app, "report", every=seconds).version))

    threads = [threading.Thread(target=edit, args=(s,)) for s in (10, 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    edits = [r for r in audit(pg_dsn, pglock_schema, app) if r["action"] == "entry_edit"]
    assert 2 == len(edits) == len(set(done))
    last = edits[-1]["detail"]["after"]["schedule"]["every"]
    stored = schedules.get(app, "report")
    assert stored is not None
    assert {"every": last} == stored.schedule
    assert edits[1]["detail"]["before"] == edits[0]["detail"]["after"]  # one after the other


# -- beat --------------------------------------------------------------------------------


def sent_slots(app: Celery, entry: str) -> list[str]:
    """The slots of ``entry`` on the app's queue, in the order sent."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    headers = [json.loads(message)["headers"] for message in reversed(raw)]
    return [h["pglock_slot"] for h in headers if h["pglock_entry"] == entry]


@pytest.fixture
def beat(app: Celery) -> Iterator[PgLockScheduler]:
    app.conf.pglock_beat_leader = False  # active-active: no election to wait for
    scheduler = PgLockScheduler(app=app)
    yield scheduler
    scheduler.close()


def tick_until(beat: PgLockScheduler, done: Any, message: str, timeout: float = 20.0) -> None:
    def ticked() -> bool:
        beat.tick()
        return bool(done())

    wait_until(ticked, timeout=timeout, interval=0.1, message=message)


def test_beat_sends_a_stored_entry_from_its_next_tick_in_its_new_form_and_not_once_removed(
    app: Celery, beat: PgLockScheduler
) -> None:
    beat.tick()  # running before the entry exists
    schedules.add(app, "pulse", TASK, every="2s")
    tick_until(beat, lambda: sent_slots(app, "pulse"), "the added entry's first slot")
    first = sent_slots(app, "pulse")[0]
    assert 0 == parse_slot(first).timestamp() % 2

    schedules.update(app, "pulse", every="5s")
    tick_until(beat, lambda: len(sent_slots(app, "pulse")) >= 2, "a slot of the new interval")
    [_, fives] = sent_slots(app, "pulse")[:2]
    assert 0 == parse_slot(fives).timestamp() % 5

    schedules.remove(app, "pulse")
    beat.tick()
    count = len(sent_slots(app, "pulse"))
    until = datetime.now(timezone.utc) + timedelta(seconds=6)  # an interval (5 s) and more
    wait_until(
        lambda: beat.tick() is not None and datetime.now(timezone.utc) > until,
        timeout=20,
        interval=0.2,
        message="an interval after the removal",
    )
    assert count == len(sent_slots(app, "pulse"))
    slots = sent_slots(app, "pulse")
    assert len(slots) == len(set(slots))  # no slot sent twice


def test_a_stored_entry_named_as_one_of_the_code_is_not_sent_and_a_warning_says_so(
    app: Celery, beat: PgLockScheduler, caplog: pytest.LogCaptureFixture
) -> None:
    schedules.add(app, "code-entry", TASK, every="1s")

    with caplog.at_level("WARNING", logger="celery_pglock.beat"):
        tick_until(beat, lambda: "both in beat_schedule" in caplog.text, "the warning")
        until = datetime.now(timezone.utc) + timedelta(seconds=2.5)  # two 1-s slots and more
        tick_until(beat, lambda: datetime.now(timezone.utc) > until, "two stored slots' time")

    assert 1 == caplog.text.count("both in beat_schedule")
    assert [] == sent_slots(app, "code-entry")  # the code's, hourly, not yet due


# -- the operator's commands see stored entries --------------------------------------------


def cli(app: Celery, *args: str) -> Any:
    from celery.bin.base import CLIContext  # noqa: PLC0415 - as the CLI tier does
    from click.testing import CliRunner  # noqa: PLC0415

    from celery_pglock.cli.command import pglock  # noqa: PLC0415

    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(pglock, list(args), obj=obj)


def test_a_stored_entry_is_paused_triggered_and_explained_like_one_of_the_code(
    app: Celery,
) -> None:
    """``pause``, ``trigger`` and ``why`` take a stored entry's name; ``why`` tells its
    changes (the audit of the entry); ``status`` names an entry both places define."""
    app.conf.beat_scheduler = "celery_pglock.beat:PgLockScheduler"
    schedules.add(app, "stored-report", TASK, every="1h", by="ann")
    schedules.add(app, "code-entry", TASK, every="1h")  # shadowed by beat_schedule's

    paused = cli(app, "pause", "stored-report", "--reason", "maintenance", "--json")
    assert 0 == paused.exit_code, paused.output
    triggered = cli(app, "trigger", "stored-report", "--json")
    assert 0 == triggered.exit_code, triggered.output
    slot = json.loads(triggered.output)["slot"]
    why = json.loads(cli(app, "why", "stored-report", slot, "--json").output)
    assert {"entry_add", "pause", "trigger"} <= {row["action"] for row in why["audit"]}

    status = cli(app, "status", "--json")
    assert 0 == status.exit_code, status.output
    assert ["code-entry"] == json.loads(status.output)["entries_shadowed"]
    assert "SHADOWED ENTRIES (1)" in cli(app, "status").output


def test_a_disabled_stored_entry_sends_nothing_its_slots_recorded_paused(
    app: Celery, beat: PgLockScheduler, pg_dsn: str, pglock_schema: str
) -> None:
    """Switched off, a stored entry is paused as a paused one is: its slots are claimed
    and recorded ``paused`` (who switched it off), never sent; switched on, it sends."""
    schedules.add(app, "quiet", TASK, every="1s", enabled=False, by="ann")
    query = sql.SQL("SELECT state, reason FROM {} WHERE entry = 'quiet'").format(
        Tables(pglock_schema).table("runs")
    )

    def paused_rows() -> list[tuple[str, str]]:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            return conn.execute(query).fetchall()

    tick_until(beat, lambda: len(paused_rows()) >= 2, "two slots recorded paused")
    assert {("paused", "disabled by ann")} == set(paused_rows())
    assert [] == sent_slots(app, "quiet")

    schedules.update(app, "quiet", enabled=True)
    tick_until(beat, lambda: sent_slots(app, "quiet"), "a slot sent once switched on")
