"""With Django configured and no ``pglock_dsn``, locked tasks use Django's database. In a
process of its own: Django's settings are configured once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import json, os, sys
import django
from django.conf import settings
import psycopg

dsn, schema, engine = sys.argv[1:4]
parts = psycopg.conninfo.conninfo_to_dict(dsn)
settings.configure(DATABASES={
    "default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
    "ledger": {
        "ENGINE": engine, "NAME": parts.get("dbname", ""), "USER": parts.get("user", ""),
        "PASSWORD": "Sup3rS3cretPw", "HOST": parts.get("host", ""),
        "PORT": parts.get("port", ""), "OPTIONS": {"sslmode": "disable", "isolation_level": 1},
    },
})
django.setup()

from celery import Celery
from celery_pglock import PgLockTask
from celery_pglock._config import app_settings

app = Celery("dj", set_as_current=False)
app.conf.update(broker_url="memory://", result_backend="cache+memory://",
                pglock_schema=schema, pglock_namespace=schema,
                pglock_django_database="ledger")

@app.task(base=PgLockTask, name="dj.job", shared=False)
def job():
    return "ran"

try:
    states = [job.apply(headers={"pglock_slot": "s"}).state for _ in range(2)]
    print(json.dumps({"states": states, "settings": repr(app_settings(app))}))
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


def run(pg_dsn: str, schema: str, engine: str) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k not in ("PGLOCK_DSN", "DATABASE_URL")}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, pg_dsn, schema, engine],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert 0 == done.returncode, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_a_django_project_needs_no_dsn_of_its_own(pg_dsn: str, pglock_schema: str) -> None:
    seen = run(pg_dsn, pglock_schema, "django.db.backends.postgresql")

    assert ["SUCCESS", "SKIPPED"] == seen.get("states"), seen
    assert "Sup3rS3cretPw" not in str(seen["settings"])


def test_a_database_that_is_not_postgresql_is_a_clear_error(
    pg_dsn: str, pglock_schema: str
) -> None:
    seen = run(pg_dsn, pglock_schema, "django.db.backends.mysql")

    assert "ConfigurationError" in str(seen.get("error"))
    assert "'ledger' is not PostgreSQL" in str(seen["error"])
    assert "Sup3rS3cretPw" not in str(seen["error"])
