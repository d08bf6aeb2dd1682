"""The connection string of a Django database, for a Django project that sets no
``pglock_dsn``: the library then uses ``DATABASES["default"]`` (or the alias in
``pglock_django_database``) with every setting Django would connect with.

Django is never imported here: it is used only when the process has configured it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import psycopg

from celery_pglock.errors import ConfigurationError

# The last part of a PostgreSQL backend's ENGINE (Django's own, PostGIS, and wrappers such
# as django-prometheus or a pooling backend that keep Django's naming).
POSTGRES_BACKENDS = ("postgresql", "postgis", "postgresql_psycopg2", "postgresql_psycopg3")
_FIELDS = {"NAME": "dbname", "USER": "user", "PASSWORD": "password", "HOST": "host", "PORT": "port"}


def django_dsn(alias: str) -> str | None:
    """The DSN of Django's database ``alias``; None when Django is not configured."""
    conf = sys.modules.get("django.conf")
    settings = getattr(conf, "settings", None)
    if settings is None or not settings.configured:
        return None
    databases: Mapping[str, Mapping[str, Any]] = getattr(settings, "DATABASES", None) or {}
    if alias not in databases:
        known = ", ".join(map(repr, databases)) or "none"
        raise ConfigurationError(
            f"pglock_django_database {alias!r} is not one of Django's DATABASES ({known})"
        )
    return conninfo(alias, databases[alias])


def conninfo(alias: str, database: Mapping[str, Any]) -> str:
    """A libpq connection string from one entry of Django's ``DATABASES``."""
    engine = str(database.get("ENGINE") or "")
    if engine.rsplit(".", 1)[-1] not in POSTGRES_BACKENDS:
        raise ConfigurationError(
            f"Django's database {alias!r} is not PostgreSQL (ENGINE {engine!r}); celery-pglock "
            "needs PostgreSQL: set pglock_dsn (Django: CELERY_PGLOCK_DSN) to one, or "
            "pglock_django_database to the alias of a PostgreSQL database"
        )
    params = {key: database.get(field) for field, key in _FIELDS.items()}
    # OPTIONS holds libpq parameters (sslmode, sslrootcert, options, service…) beside
    # Django's own (isolation_level, pool…), which libpq would refuse.
    libpq = {option.keyword.decode() for option in psycopg.pq.Conninfo.get_defaults()}
    params.update({k: v for k, v in (database.get("OPTIONS") or {}).items() if k in libpq})
    return psycopg.conninfo.make_conninfo(
        **{k: str(v) for k, v in params.items() if v not in (None, "")}
    )


__all__ = ["conninfo", "django_dsn"]
