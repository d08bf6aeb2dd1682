"""Django's DATABASES as a connection string (no Django configured here: the pure part)."""

from __future__ import annotations

import psycopg
import pytest

from celery_pglock import ConfigurationError
from celery_pglock._config import Settings
from celery_pglock._django_db import conninfo

POSTGRES = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": "app",
    "USER": "app",
    "PASSWORD": "Sup3rS3cretPw",
    "HOST": "db.internal",
    "PORT": 6432,
    "OPTIONS": {"sslmode": "verify-full", "sslrootcert": "/etc/ca.pem", "isolation_level": 2},
}


def test_every_setting_django_connects_with_is_kept() -> None:
    params = psycopg.conninfo.conninfo_to_dict(conninfo("default", POSTGRES))

    assert {
        "dbname": "app",
        "user": "app",
        "password": "Sup3rS3cretPw",
        "host": "db.internal",
        "port": "6432",
        "sslmode": "verify-full",
        "sslrootcert": "/etc/ca.pem",
    } == params  # isolation_level is Django's own, not libpq's: left out


def test_the_password_is_never_shown() -> None:
    settings = Settings(dsn=conninfo("default", POSTGRES))

    assert "Sup3rS3cretPw" not in repr(settings)


def test_empty_fields_are_left_to_libpq_defaults() -> None:
    local = {"ENGINE": "django.contrib.gis.db.backends.postgis", "NAME": "app", "HOST": ""}

    assert {"dbname": "app"} == psycopg.conninfo.conninfo_to_dict(conninfo("gis", local))


def test_a_database_that_is_not_postgresql_is_refused_naming_the_fix() -> None:
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": "db.sqlite3"}

    with pytest.raises(ConfigurationError, match=r"not PostgreSQL.*CELERY_PGLOCK_DSN"):
        conninfo("default", sqlite)
