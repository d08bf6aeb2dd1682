"""Where the library meets the driver (``celery_pglock.store._failures``): an outage (waiting
cures it) told from a misconfiguration (only a fix does) and a session that ended from a
statement that failed, by the errors psycopg raises for each (real servers raising them:
test_connect_errors.py); and no module above the connection layer catches the driver's."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import psycopg
import pytest
from psycopg import errors

from celery_pglock._config import Settings
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    ReadOnlyServer,
    SessionGone,
    StatementFailed,
    WaitEnded,
)
from celery_pglock.store._failures import misconfiguration, translate

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
    """translate, while connecting: an outage is a DatabaseUnavailable, a misconfiguration also a
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

    assert isinstance(found, ReadOnlyServer)
    assert isinstance(found, DatabaseMisconfigured)
    assert "target_session_attrs=read-write" in str(found)


LIVE = SimpleNamespace(closed=False, broken=False)  # what translate reads of a session
BROKEN = SimpleNamespace(closed=False, broken=True)


@pytest.mark.parametrize(
    ("exc", "conn", "kind"),
    [
        (OUTAGES["terminated"], LIVE, SessionGone),
        (errors.IdleInTransactionSessionTimeout("terminating connection"), BROKEN, SessionGone),
        (psycopg.InternalError("server closed the connection"), BROKEN, SessionGone),
        (errors.LockNotAvailable("canceling statement due to lock timeout"), LIVE, WaitEnded),
        (errors.QueryCanceled("canceling statement due to statement timeout"), LIVE, WaitEnded),
        (errors.InsufficientPrivilege("permission denied for function"), LIVE, StatementFailed),
        (errors.InFailedSqlTransaction("current transaction is aborted"), LIVE, StatementFailed),
    ],
    ids=["ended", "idle-timeout", "broken", "lock-timeout", "canceled", "privilege", "aborted"],
)
def test_an_error_on_a_session_says_whether_the_session_lives(
    exc: psycopg.Error, conn: SimpleNamespace, kind: type
) -> None:
    """On an established session: SessionGone when it ended (the locks went with it),
    else a statement's own failure, with its SQLSTATE and the driver's class in ``cause``."""
    found = translate(exc, conn=conn)

    assert kind is type(found)
    assert (exc.sqlstate, type(exc).__name__) == (found.sqlstate, found.cause.split(":")[0])


PACKAGE = Path(__file__).resolve().parents[2] / "celery_pglock"
# The store (it translates) and code outside the library proper.
MAY_CATCH_DRIVER_ERRORS = {
    "store/_database.py": "the pool: a connection failing its reset or first statement is dropped",
    "store/_failures.py": "the translation itself",
    "store/_connections.py": "closing and cancelling a session that may be gone already",
    "store/_pool.py": "it reads the replies of idle connections, and drops broken ones",
    "_dsn.py": "parsing a DSN, before any server is involved",
    "demo/_server.py": "the demo's embedded server, not the library",
}


def _catches_driver_error(handler: ast.ExceptHandler) -> bool:
    names = ast.unparse(handler.type) if handler.type is not None else ""
    return "psycopg" in names or "TRANSIENT" in names or "WAIT_ENDED" in names


def test_only_the_connection_layer_catches_driver_errors() -> None:
    """Above the connection layer, modules catch the library's errors only: what a driver
    error means is decided once, in ``failures``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in MAY_CATCH_DRIVER_ERRORS or name.startswith("testing/"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        handlers = [node for node in ast.walk(tree) if isinstance(node, ast.ExceptHandler)]
        found += [f"{name}:{h.lineno}" for h in handlers if _catches_driver_error(h)]

    assert [] == found
