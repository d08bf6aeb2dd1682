"""Django settings: django-celery-beat's tables in the test's own PostgreSQL schema.

``PGLOCK_DSN`` names the server, ``TEST_SCHEMA`` the schema (through ``search_path``), so
each test gets fresh tables that are dropped with its schema.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict

_PG = conninfo_to_dict(os.environ["PGLOCK_DSN"])

SECRET_KEY = "celery-pglock-tests-only"  # noqa: S105 - not a secret: a throwaway test project
INSTALLED_APPS = ["django_celery_beat"]
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _PG.get("dbname", ""),
        "USER": _PG.get("user", ""),
        "PASSWORD": _PG.get("password", ""),
        "HOST": _PG.get("host", ""),
        "PORT": _PG.get("port", ""),
        "OPTIONS": {"options": f"-c search_path={os.environ['TEST_SCHEMA']}"},
    }
}
