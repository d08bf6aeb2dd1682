"""An outage (waiting cures it) told from a misconfiguration (only a fix does), by the
errors psycopg raises for each; real servers raising them: test_connect_errors.py."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import errors

from celery_pglock.config import Settings
from celery_pglock.errors import ConfigurationError, DatabaseMisconfigured, DatabaseUnavailable
from celery_pglock.failures import misconfiguration, translate

FAILED = 'connection failed: connection to server at "127.0.0.1", port 5432 failed: '
PASSWORD = "Sup3rS3cret"  # noqa: S105 - fake; must never be printed

OUTAGES = {
    "refused": psycopg.OperationalError(
        f"{FAILED}Connection refused\n\tIs the server running on that host?"
    ),
    "timeout": psycopg.OperationalError(f"{FAILED}timeout expired"),
    "starting-up": psycopg.OperationalError(f"{FAILED}FATAL:  the database system is starting up"),
    "shutting-down": errors.CannotConnectNow("the database system is shutting down"),
    "in-recovery": psycopg.OperationalError(
        f"{FAILED}FATAL:  the database system is in recovery mode"
    ),
    "no-writable-host-yet": psycopg.OperationalError(f"{FAILED}session is read-only"),
    "too-many-clients": psycopg.OperationalError(
        f"{FAILED}FATAL:  sorry, too many clients already"
    ),
    "role-limit": errors.TooManyConnections('too many connections for role "app"'),
    "terminated": errors.AdminShutdown("terminating connection due to administrator command"),
    "crash": errors.CrashShutdown("terminating connection because of crash of another server"),
    "pgbouncer-login": errors.ProtocolViolation("server login has been failing, try again later"),
    "dns": psycopg.OperationalError('connection failed: could not translate host name "db"'),
}
MISCONFIGURATIONS = {
    "password": psycopg.OperationalError(
        f'{FAILED}FATAL:  password authentication failed for user "app"'
    ),
    "no-password": psycopg.OperationalError(f"{FAILED}fe_sendauth: no password supplied"),
    "unknown-role": psycopg.OperationalError(f'{FAILED}FATAL:  role "nobody" does not exist'),
    "unknown-database": psycopg.OperationalError(f'{FAILED}FATAL:  database "nodb" does not exist'),
    "pg-hba": psycopg.OperationalError(f'{FAILED}FATAL:  no pg_hba.conf entry for host "10.0.0.9"'),
    "no-login": psycopg.OperationalError(f'{FAILED}FATAL:  role "app" is not permitted to log in'),
    "no-connect": psycopg.OperationalError(f'{FAILED}FATAL:  permission denied for database "app"'),
    "schema-privileges": errors.InsufficientPrivilege("permission denied for schema app"),
    "unknown-schema": errors.InvalidSchemaName('schema "nope" does not exist'),
    "invalid-option": psycopg.ProgrammingError('invalid connection option "foo"'),
}


@pytest.mark.parametrize("exc", OUTAGES.values(), ids=OUTAGES.keys())
def test_an_outage_is_not_a_misconfiguration(exc: psycopg.Error) -> None:
    """Down, starting, shutting down, in recovery, full, ended: waiting cures it."""
    assert None is misconfiguration(exc)


@pytest.mark.parametrize("exc", MISCONFIGURATIONS.values(), ids=MISCONFIGURATIONS.keys())
def test_a_misconfiguration_names_its_fix(exc: psycopg.Error) -> None:
    """Credentials, names, privileges, options: a fix is named, no waiting."""
    fix = misconfiguration(exc)

    assert fix is not None
    assert fix.split()[0] in {"check", "add", "allow", "give", "grant", "create"}


def test_translated_errors_keep_both_kinds_apart_and_the_password_out() -> None:
    """translate: an outage is a DatabaseUnavailable, a misconfiguration also a
    ConfigurationError naming the fix; neither prints the password."""
    settings = Settings(dsn=f"postgresql://app:{PASSWORD}@127.0.0.1:5432/app")

    outage = translate(OUTAGES["refused"], settings)
    wrong = translate(MISCONFIGURATIONS["password"], settings)

    assert (DatabaseUnavailable, False) == (type(outage), isinstance(outage, ConfigurationError))
    assert (DatabaseMisconfigured, True) == (type(wrong), isinstance(wrong, DatabaseUnavailable))
    assert "To fix: check the password in pglock_dsn" in str(wrong)
    assert [] == [text for text in (str(outage), str(wrong)) if PASSWORD in text]


def test_a_read_only_server_is_a_misconfiguration() -> None:
    """A DSN that reaches only a read-only server names target_session_attrs=read-write."""
    exc = errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")

    found = translate(exc, Settings(dsn="postgresql://app@db/app"))

    assert isinstance(found, DatabaseMisconfigured)
    assert "target_session_attrs=read-write" in str(found)
