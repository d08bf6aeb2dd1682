"""``celery pglock entries import`` from each source, each started for real: the app's
``beat_schedule``; django-celery-beat's tables (Django migrated and its entries made
through its models, in a process of its own); RedBeat's keys in a real Redis (written by
RedBeat's own code); and ``entries export``'s file. Every entry is listed with what it
became, and what cannot be carried over is named, never dropped silently."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.schedules import crontab
from click.testing import CliRunner, Result

from celery_pglock import schedules
from celery_pglock.cli.command import pglock
from celery_pglock.store._database import close_all

pytestmark = pytest.mark.integration

redbeat = pytest.importorskip("redbeat", reason="needs celery-redbeat (the test extra)")


@pytest.fixture
def app(pg_dsn: str, pglock_schema: str, redis_url: str) -> Iterator[Celery]:
    app = Celery(f"imp{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=redis_url,
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
        redbeat_redis_url=redis_url,
        redbeat_key_prefix=f"rb-{uuid.uuid4().hex[:6]}:",
        timezone="Europe/Paris",
    )
    yield app
    app.close()
    close_all()


def invoke(app: Celery, *args: str) -> Result:
    from celery.bin.base import CLIContext  # noqa: PLC0415 - as the test_cli tier does

    return CliRunner().invoke(
        pglock, ["entries", *args], obj=CLIContext(app=app, no_color=True, workdir=None)
    )


def stored(app: Celery) -> dict[str, tuple[str, dict[str, Any]]]:
    return {e.name: (e.task, e.schedule) for e in schedules.entries(app)}


def test_beat_schedule_is_listed_dry_then_stored_and_what_has_no_stored_form_is_named(
    app: Celery,
) -> None:
    app.conf.beat_schedule = {
        "every-10s": {
            "task": "proj.ping",
            "schedule": 10.0,
            "options": {"queue": "fast", "pglock_catch_up": "latest"},
        },
        "nightly": {"task": "proj.close", "schedule": crontab(minute=0, hour=2), "args": [1]},
        "odd": {"task": "proj.odd", "schedule": 60.0, "relative": True},
    }

    dry = invoke(app, "import", "--from", "config", "--dry-run", "--force")

    assert 1 == dry.exit_code
    assert "every-10s: proj.ping every 10s" in dry.output
    assert "nightly: proj.close cron 0 2 * * *" in dry.output
    assert "odd: NOT CARRIED OVER: option(s) ['relative'] have no stored form" in dry.output
    assert {} == stored(app)

    done = invoke(app, "import", "--from", "config", "--force")

    assert 1 == done.exit_code
    assert {
        "every-10s": ("proj.ping", {"every": 10.0}),
        "nightly": ("proj.close", {"cron": "0 2 * * *"}),
    } == stored(app)
    [ping] = [e for e in schedules.entries(app) if e.name == "every-10s"]
    assert ({"queue": "fast"}, {"catch_up": "latest"}) == (ping.options, ping.pglock)


def test_redbeat_s_entries_are_read_from_its_keys(app: Celery) -> None:
    from dateutil.rrule import MINUTELY  # noqa: PLC0415 - RedBeat's own dependency
    from redbeat.schedules import rrule  # noqa: PLC0415

    entry = redbeat.RedBeatSchedulerEntry
    entry("rb-every", "proj.ping", timedelta(seconds=30), args=[7], app=app).save()
    entry("rb-cron", "proj.report", crontab(minute="*/5"), kwargs={"to": "ops"}, app=app).save()
    entry("rb-rrule", "proj.odd", rrule(MINUTELY, interval=3), app=app).save()

    done = invoke(app, "import", "--from", "redbeat", "--force")

    assert 1 == done.exit_code, done.output
    assert "rb-rrule: NOT CARRIED OVER: RedBeat schedule" in done.output
    assert {
        "rb-every": ("proj.ping", {"every": 30.0}),
        "rb-cron": ("proj.report", {"cron": "*/5 * * * *"}),
    } == stored(app)
    client = redis.Redis.from_url(app.conf.redbeat_redis_url)
    try:
        client.delete(*client.keys(app.conf.redbeat_key_prefix + "*"))
    finally:
        client.close()


DJANGO = """
import sys
import django
import psycopg
from django.conf import settings

dsn, schema = sys.argv[1:3]
parts = psycopg.conninfo.conninfo_to_dict(dsn)
settings.configure(
    USE_TZ=True, TIME_ZONE="UTC", SECRET_KEY="tests-only",
    INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_celery_beat"],
    DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": parts.get("dbname", ""),
        "USER": parts.get("user", ""), "HOST": parts.get("host", ""),
        "PORT": parts.get("port", ""), "OPTIONS": {"options": f"-c search_path={schema}"},
    }},
    DEFAULT_AUTO_FIELD="django.db.models.AutoField",
)
django.setup()
from django.core.management import call_command
call_command("migrate", verbosity=0)

import datetime, json, zoneinfo
from django_celery_beat.models import (
    ClockedSchedule, CrontabSchedule, IntervalSchedule, PeriodicTask,
)
every = IntervalSchedule.objects.create(every=15, period=IntervalSchedule.MINUTES)
PeriodicTask.objects.create(name="dj-every", task="proj.ping", interval=every,
                            args=json.dumps([1]), queue="slow")
cron = CrontabSchedule.objects.create(minute="30", hour="7", day_of_week="1-5",
                                      timezone=zoneinfo.ZoneInfo("America/New_York"))
PeriodicTask.objects.create(name="dj-cron", task="proj.report", crontab=cron,
                            kwargs=json.dumps({"to": "ops"}), enabled=False)
at = datetime.datetime(2099, 12, 24, 9, 0, tzinfo=datetime.timezone.utc)
PeriodicTask.objects.create(name="dj-once", task="proj.greet", one_off=True,
                            clocked=ClockedSchedule.objects.create(clocked_time=at))
PeriodicTask.objects.create(name="dj-expiring", task="proj.ping", interval=every,
                            expire_seconds=30)
"""


def test_django_celery_beat_s_entries_are_read_from_its_tables(
    app: Celery, pg_dsn: str, pglock_schema: str, tmp_path: Path
) -> None:
    script = tmp_path / "dcb.py"
    script.write_text(DJANGO)
    subprocess.run([sys.executable, str(script), pg_dsn, pglock_schema], check=True, timeout=120)
    django_dsn = f"{pg_dsn}?options=-csearch_path%3D{pglock_schema}"

    done = invoke(app, "import", "--from", "django", django_dsn, "--force")

    assert 1 == done.exit_code, done.output
    assert "dj-expiring: NOT CARRIED OVER: option(s) ['expire_seconds']" in done.output
    assert {
        "dj-every": ("proj.ping", {"every": 900.0}),
        "dj-cron": ("proj.report", {"cron": "30 7 * * 1-5", "tz": "America/New_York"}),
        "dj-once": ("proj.greet", {"at": "2099-12-24T09:00:00+00:00"}),
    } == stored(app)
    found = {e.name: e for e in schedules.entries(app)}
    assert ([1], {"queue": "slow"}) == (found["dj-every"].args, found["dj-every"].options)
    assert (False, {"to": "ops"}) == (found["dj-cron"].enabled, found["dj-cron"].kwargs)


def test_an_export_is_imported_back_as_it_was(app: Celery, tmp_path: Path) -> None:
    schedules.add(
        app,
        "report",
        "proj.report",
        cron="0 8 * * mon",
        tz="Asia/Tokyo",
        force=True,
        kwargs={"a": 1},
    )
    schedules.add(app, "ping", "proj.ping", every="45s", queue="fast", force=True, enabled=False)
    path = tmp_path / "entries.json"
    assert 0 == invoke(app, "export", str(path)).exit_code
    before = {e.name: e.values() for e in schedules.entries(app)}
    for name in before:
        schedules.remove(app, name)

    done = invoke(app, "import", "--from", "file", str(path), "--force")

    assert 0 == done.exit_code, done.output
    assert before == {e.name: e.values() for e in schedules.entries(app)}
    assert "ping" == json.loads(path.read_text())[0]["name"]


def test_a_source_that_cannot_be_read_is_one_clear_line_never_a_password(app: Celery) -> None:
    """An unreachable Redis (its password hidden) or a database without django-celery-beat's
    tables: one line naming what to fix, exit status 2, nothing stored."""
    unreachable = invoke(app, "import", "--from", "redbeat", "redis://:s3cret@127.0.0.1:1/0")
    no_tables = invoke(app, "import", "--from", "django")

    assert (2, 2) == (unreachable.exit_code, no_tables.exit_code), unreachable.output
    assert "cannot read RedBeat's entries from Redis" in unreachable.output
    assert "s3cret" not in unreachable.output
    assert "no django-celery-beat tables to read" in no_tables.output
    assert {} == stored(app)
