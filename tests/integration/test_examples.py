"""The examples run: ``examples/plain`` and ``examples/django`` against the test PostgreSQL.

Each is imported as its users would (``proj``, ``mysite``), with an in-memory broker and
result backend, an in-process worker, and two beat scheduler replicas ticking side by side.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from celery_pglock import SKIPPED, PgLockMixin
from celery_pglock._config import app_settings
from celery_pglock.beat import PgLockScheduler, PgLockSchedulerMixin
from tests.fixtures.pg import fresh_schema
from tests.fixtures.procs import wait_until

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SLOT = "2026-11-29T18:05:00Z"
SENT_SLOTS = 3  # 1-s slots the replicas tick through side by side
TICK_DEADLINE = 15.0  # seconds; three slots take about three


@contextlib.contextmanager
def example(name: str, env: dict[str, str], *packages: str) -> Iterator[None]:
    """``examples/<name>`` importable with ``env`` set; its modules forgotten afterwards."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(EXAMPLES / name))
        for key, value in env.items():
            patch.setenv(key, value)
        try:
            yield
        finally:
            for module in [m for m in sys.modules if m.split(".")[0] in packages]:
                del sys.modules[module]


def tick_replicas(schedulers: list[Any], sent: Callable[[], list[Any]]) -> None:
    """Tick every replica, as their ``celery beat`` loops would, until ``sent()`` lists
    ``SENT_SLOTS`` slots."""

    def ticked() -> bool:
        for scheduler in schedulers:
            scheduler.tick()
        return len(sent()) >= SENT_SLOTS

    wait_until(ticked, timeout=TICK_DEADLINE, message=f"{SENT_SLOTS} slots sent")


def beat_sends(dsn: str, schema: str, entry: str) -> list[tuple[str, int]]:
    query = sql.SQL("SELECT slot, sends FROM {} WHERE entry = %s AND sent_at IS NOT NULL").format(
        sql.Identifier(schema, "pglock_beat_sends")
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(row[0], row[1]) for row in conn.execute(query, (entry,))]


def succeeded_slots(dsn: str, schema: str, task: str) -> list[str]:
    query = sql.SQL("SELECT slot FROM {} WHERE task_name = %s AND state = 'succeeded'").format(
        sql.Identifier(schema, "pglock_runs")
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        return sorted(row[0] for row in conn.execute(query, (task,)))


# -- examples/plain -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(pg_dsn: str) -> Iterator[tuple[Celery, str]]:
    """``proj.app`` on the test PostgreSQL (its own schema), memory broker and backend."""
    env = {"DATABASE_URL": pg_dsn, "CELERY_BROKER_URL": "memory://"}
    with fresh_schema(pg_dsn) as schema, example("plain", env, "proj"):
        app: Celery = importlib.import_module("proj").app
        app.conf.update(
            result_backend="cache+memory://", pglock_schema=schema, task_default_queue="plain"
        )
        app.loader.import_default_modules()  # what `celery worker` and `celery beat` do
        with start_worker(app, pool="solo", perform_ping_check=False):
            yield app, schema


def test_plain_example_retrofit_locks_every_task(plain: tuple[Celery, str], pg_dsn: str) -> None:
    """The three lines: tasks are PgLockTasks, beat is PgLockScheduler, the DSN is DATABASE_URL."""
    app, _ = plain
    tasks = [task for name, task in app.tasks.items() if name.startswith("proj.")]

    assert len(tasks) == 2
    assert all(isinstance(task, PgLockMixin) for task in tasks)
    assert app.conf.beat_scheduler == "celery_pglock.beat:PgLockScheduler"
    assert app.conf.pglock_dsn == pg_dsn


def test_plain_example_skips_a_second_delivery_of_a_slot(plain: tuple[Celery, str]) -> None:
    """The same slot delivered twice to a real worker: the first runs, the second is SKIPPED."""
    app, _ = plain
    task = app.tasks["proj.tasks.nightly_report"]

    first = task.apply_async(headers={"pglock_slot": SLOT})
    assert first.get(timeout=15) == SLOT
    second = task.apply_async(headers={"pglock_slot": SLOT})
    meta = second.get(timeout=15)

    assert (SKIPPED, "done") == (second.state, meta["reason"])


def test_plain_example_beat_replicas_send_each_slot_once(
    plain: tuple[Celery, str], pg_dsn: str
) -> None:
    """Two PgLockScheduler replicas ticking together: each slot sent once and run once."""
    app, schema = plain
    every_second = {"task": "proj.tasks.send_reminders", "schedule": 1.0}
    app.conf.beat_schedule = {"send-reminders": every_second}
    replicas = [PgLockScheduler(app=app), PgLockScheduler(app=app)]
    try:
        tick_replicas(replicas, lambda: beat_sends(pg_dsn, schema, "send-reminders"))
    finally:
        for replica in replicas:
            replica.close()
    sends = beat_sends(pg_dsn, schema, "send-reminders")
    slots = sorted(slot for slot, _ in sends)
    wait_until(
        lambda: succeeded_slots(pg_dsn, schema, "proj.tasks.send_reminders") == slots,
        timeout=15,
        message="every sent slot to run",
    )

    assert len(slots) >= 2
    assert {1} == {count for _, count in sends}


# -- examples/django ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def django_example(pg_dsn: str) -> Iterator[tuple[Celery, str]]:
    """``mysite`` on a fresh database of the test server, migrated; memory broker."""
    dbname = f"pglock_example_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = make_conninfo(pg_dsn, dbname=dbname)
    env = {"DATABASE_URL": dsn, "CELERY_BROKER_URL": "memory://"}
    env["DJANGO_SETTINGS_MODULE"] = "mysite.settings"
    try:
        with example("django", env, "mysite", "billing"):
            yield _setup_django(), dsn
    finally:
        _drop_database(pg_dsn, dbname)


def _setup_django() -> Celery:
    import django  # noqa: PLC0415 - only for the Django example
    from django.conf import settings  # noqa: PLC0415
    from django.core.management import call_command  # noqa: PLC0415

    if settings.configured and settings.SETTINGS_MODULE != "mysite.settings":
        raise RuntimeError(f"Django already runs {settings.SETTINGS_MODULE} in this process")
    django.setup()
    call_command("migrate", verbosity=0, interactive=False)
    app: Celery = importlib.import_module("mysite").celery_app
    app.conf.update(result_backend="cache+memory://", task_default_queue="django")
    return app


def _drop_database(admin_dsn: str, dbname: str) -> None:
    with contextlib.suppress(ImportError):
        from django.db import connections  # noqa: PLC0415

        connections.close_all()
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname))
        conn.execute(drop)


def test_django_example_scheduler_is_database_scheduler_with_the_mixin(
    django_example: tuple[Celery, str],
) -> None:
    """CELERY_BEAT_SCHEDULER names DatabaseScheduler plus the mixin; locks use Django's
    default database (no pglock_dsn of its own)."""
    from django_celery_beat.schedulers import DatabaseScheduler  # noqa: PLC0415

    app, dsn = django_example
    scheduler = importlib.import_module("mysite.scheduler").Scheduler

    assert app.conf.beat_scheduler == "mysite.scheduler:Scheduler"
    assert issubclass(scheduler, PgLockSchedulerMixin)
    assert issubclass(scheduler, DatabaseScheduler)
    assert app.conf.get("pglock_dsn") is None
    assert conninfo_to_dict(app_settings(app).dsn)["dbname"] == conninfo_to_dict(dsn)["dbname"]


def test_django_example_runs_each_periodic_task_slot_once(
    django_example: tuple[Celery, str],
) -> None:
    """A 1-s PeriodicTask, two beat replicas, a worker: one Rollup per slot, each slot sent once."""
    from django_celery_beat.models import IntervalSchedule, PeriodicTask  # noqa: PLC0415

    app, dsn = django_example
    rollup = importlib.import_module("billing.models").Rollup
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.create(name="rollup", task="billing.tasks.nightly_rollup", interval=every)
    scheduler = importlib.import_module("mysite.scheduler").Scheduler
    with start_worker(app, pool="solo", perform_ping_check=False):
        replicas = [scheduler(app=app), scheduler(app=app)]
        try:
            tick_replicas(replicas, lambda: beat_sends(dsn, "public", "rollup"))
        finally:
            for replica in replicas:
                replica.close()
        sends = beat_sends(dsn, "public", "rollup")
        slots = sorted(slot for slot, _ in sends)
        wait_until(
            lambda: sorted(rollup.objects.values_list("slot", flat=True)) == slots,
            timeout=15,
            message="a Rollup for every sent slot",
        )

    assert len(slots) >= 2
    assert {1} == {count for _, count in sends}
