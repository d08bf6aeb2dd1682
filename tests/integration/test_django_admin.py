"""``celery_pglock.contrib.django``: the ledger in Django's admin, read-only, through
Django's test client. In a process of its own (Django's settings are per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SCRIPT = """
import json, sys
import django
import psycopg
from django.conf import settings

dsn, schema = sys.argv[1:3]
parts = psycopg.conninfo.conninfo_to_dict(dsn)
settings.configure(
    DEBUG=True,
    SECRET_KEY="tests-only",
    ROOT_URLCONF=__name__,
    ALLOWED_HOSTS=["testserver"],
    USE_TZ=True,
    INSTALLED_APPS=[
        "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
        "django.contrib.sessions", "django.contrib.messages", "celery_pglock.contrib.django",
    ],
    MIDDLEWARE=[
        "django.contrib.sessions.middleware.SessionMiddleware",
        "django.contrib.auth.middleware.AuthenticationMiddleware",
        "django.contrib.messages.middleware.MessageMiddleware",
    ],
    TEMPLATES=[{
        "BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True,
        "OPTIONS": {"context_processors": [
            "django.template.context_processors.request",
            "django.contrib.auth.context_processors.auth",
            "django.contrib.messages.context_processors.messages",
        ]},
    }],
    DATABASES={"default": {
        "ENGINE": "django.db.backends.postgresql", "NAME": parts.get("dbname", ""),
        "USER": parts.get("user", ""), "HOST": parts.get("host", ""),
        "PORT": parts.get("port", ""), "OPTIONS": {"options": f"-c search_path={schema}"},
    }},
    CELERY_PGLOCK_SCHEMA=schema,
    DEFAULT_AUTO_FIELD="django.db.models.AutoField",
)
django.setup()

from django.contrib import admin
from django.urls import path
urlpatterns = [path("admin/", admin.site.urls)]

from django.core.management import call_command
call_command("migrate", verbosity=0)

from celery_pglock._config import Settings
from celery_pglock.store._database import close_all, database
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim

db = database(Settings(dsn=dsn, schema=schema))
name = f"{schema}:billing.nightly"
claim = Claim(name, lock_key(name), "2026-12-01", "t-ran", "billing.nightly")
release(db, acquire(db, claim, "session", None), "succeeded")
acquire(db, Claim(name, lock_key(name), "2026-12-01", "t-dup", "billing.nightly"), "session", None)
close_all()

from django.contrib.auth.models import User
from django.test import Client
user = User.objects.create_superuser("ops", "ops@example.com", "pw")
client = Client()
client.force_login(user)
pages = {}
for model in ("run", "skip", "holder"):
    response = client.get(f"/admin/celery_pglock/{model}/")
    pages[model] = [response.status_code, response.content.decode()]
add = client.get("/admin/celery_pglock/run/add/").status_code
print(json.dumps({"pages": pages, "add": add}))
"""


def test_the_ledger_is_listed_in_the_admin_and_cannot_be_changed(
    pg_dsn: str, pglock_schema: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, pg_dsn, pglock_schema],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("DJANGO_")},
        check=False,
    )
    assert 0 == done.returncode, done.stderr[-3000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    runs, skips, holders = (seen["pages"][m] for m in ("run", "skip", "holder"))

    assert [200, 200, 200] == [runs[0], skips[0], holders[0]]
    assert "billing.nightly" in runs[1]
    assert "2026-12-01" in runs[1]
    assert "succeeded" in runs[1]
    assert "done" in skips[1]
    assert "t-dup" in skips[1]
    assert "billing.nightly" in holders[1]
    assert 403 == seen["add"]
