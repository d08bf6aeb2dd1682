"""What a process meets when it connects, from real servers: an outage (waiting cures it:
a ``DatabaseUnavailable``) or a misconfiguration (only a fix does: a ``DatabaseMisconfigured``,
also a ``ConfigurationError``, naming the fix). Servers that are stopped or reconfigured
are throwaway ones of each test."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from celery_pglock._config import Settings
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseMisconfigured,
    DatabaseUnavailable,
    SessionGone,
    StatementFailed,
)
from celery_pglock.store._connections import connect
from celery_pglock.store._database import check_server
from celery_pglock.store._failures import boundary
from celery_pglock.store._ping import answering
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.fixtures.pg import ROLE_PASSWORD, require_password, started_embedded

pytestmark = pytest.mark.integration

PASSWORD = ROLE_PASSWORD  # the role fixture's: must never be printed


def outage(dsn: str, **settings: Any) -> DatabaseUnavailable:
    """The error ``check_server`` raised, which must be an outage."""
    with pytest.raises(DatabaseUnavailable) as raised:
        check_server(Settings(dsn=dsn, connect_timeout=2, **settings))
    assert not isinstance(raised.value, ConfigurationError), raised.value
    return raised.value


def misconfigured(dsn: str, **settings: Any) -> ConfigurationError:
    """The error ``check_server`` raised, which must be a misconfiguration."""
    with pytest.raises(ConfigurationError) as raised:
        check_server(Settings(dsn=dsn, connect_timeout=2, **settings))
    assert PASSWORD not in str(raised.value)
    return raised.value


# -- outages ------------------------------------------------------------------------------


def test_a_stopped_server_is_an_outage(private_pg: EmbeddedPostgres) -> None:
    """Connection refused: waiting cures it."""
    private_pg.stop()

    found = outage(private_pg.dsn)

    assert "Connection refused" in str(found) or "connection refused" in str(found).lower()


def test_a_terminated_session_is_an_outage(pg_dsn: str, pg_conn: psycopg.Connection[Any]) -> None:
    """A session ended by pg_terminate_backend (a restart, an operator): its locks are
    gone (SessionGone), an outage, and the cause names the driver's error."""
    settings = Settings(dsn=pg_dsn)
    conn = connect(settings)
    try:
        pg_conn.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        with pytest.raises(SessionGone) as raised, boundary(settings, conn):
            conn.execute("SELECT 1")
    finally:
        conn.close()
    assert not isinstance(raised.value, ConfigurationError), raised.value
    assert raised.value.cause.startswith("AdminShutdown: terminating connection"), raised.value


def test_a_failed_statement_leaves_the_session_alive(pg_dsn: str) -> None:
    """An error of the statement's own (here an unknown column) is StatementFailed,
    with its SQLSTATE: the session, and the locks it holds, live on."""
    settings = Settings(dsn=pg_dsn)
    with connect(settings) as conn:
        with pytest.raises(StatementFailed) as raised, boundary(settings, conn):
            conn.execute("SELECT no_such_column FROM pg_class")
        assert (1,) == conn.execute("SELECT 1").fetchone()
    assert ("42703", False) == (raised.value.sqlstate, isinstance(raised.value, SessionGone))


def test_a_role_out_of_connection_slots_is_an_outage(
    pg_dsn: str, pg_conn: psycopg.Connection[Any], role: str
) -> None:
    """`too many connections for role`: connections end, slots come back."""
    pg_conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT 0").format(sql.Identifier(role)))

    found = outage(make_conninfo(pg_dsn, user=role, password=PASSWORD))

    assert "too many connections" in str(found)


def test_a_server_with_no_writable_host_yet_is_an_outage(private_pg: EmbeddedPostgres) -> None:
    """target_session_attrs=read-write and only a read-only server answering (a failover
    in progress): an outage, whereas the same server without it is a misconfiguration."""
    private_pg.set_config(default_transaction_read_only="on")
    waiting = make_conninfo(private_pg.dsn, target_session_attrs="read-write")

    found = outage(waiting)
    wrong = misconfigured(private_pg.dsn)

    assert "read-only" in str(found)
    assert "target_session_attrs=read-write" in str(wrong)


# -- misconfigurations --------------------------------------------------------------------


def test_a_wrong_password_is_a_misconfiguration(private_pg: EmbeddedPostgres) -> None:
    """Password authentication failed: the fix names the password, which is not printed."""
    require_password(private_pg, "app", PASSWORD)
    dsn = f"postgresql://app:{PASSWORD}x@127.0.0.1:{private_pg.port}/postgres"

    found = misconfigured(dsn)

    assert isinstance(found, DatabaseMisconfigured)
    assert "To fix: check the password in pglock_dsn" in str(found)


@pytest.mark.parametrize("what", ["database", "role"])
def test_an_unknown_database_or_role_is_a_misconfiguration(pg_dsn: str, what: str) -> None:
    """A database or role the server does not know: the fix names pglock_dsn."""
    dsn = make_conninfo(pg_dsn, **{"dbname" if what == "database" else "user": "no_such_x"})

    found = misconfigured(dsn)

    assert "does not exist" in str(found)
    assert "pglock_dsn" in str(found)


def test_a_role_that_may_not_log_in_is_a_misconfiguration(
    pg_dsn: str, pg_conn: psycopg.Connection[Any], role: str
) -> None:
    """NOLOGIN: the fix names the LOGIN attribute."""
    pg_conn.execute(sql.SQL("ALTER ROLE {} NOLOGIN").format(sql.Identifier(role)))

    found = misconfigured(make_conninfo(pg_dsn, user=role, password=PASSWORD))

    assert "LOGIN" in str(found)


def test_missing_privileges_on_the_schema_are_a_misconfiguration(
    pg_dsn: str, pg_conn: psycopg.Connection[Any], pglock_schema: str, role: str
) -> None:
    """A role that may not create our tables in pglock_schema: the fix names the grant."""
    dsn = make_conninfo(pg_dsn, user=role, password=PASSWORD)

    found = misconfigured(dsn, schema=pglock_schema)

    assert "grant the role USAGE and CREATE" in str(found)


def test_an_invalid_connection_option_is_a_misconfiguration(pg_dsn: str) -> None:
    """An option libpq does not know: a misconfiguration, not an outage."""
    found = misconfigured(f"{make_conninfo(pg_dsn)} no_such_option=1")

    assert "no_such_option" in str(found)


def test_pings_tell_which_servers_answer(private_pg: EmbeddedPostgres) -> None:
    """store.ping.answering, on a DSN naming a stopped server and a running one: each is
    pinged alone (no session), the running one answers; the stopped one once started."""
    other = make_conninfo(private_pg.dsn)  # the running one, by keywords
    with started_embedded() as stopped_one:
        hosts = f"127.0.0.1:{stopped_one.port},127.0.0.1:{private_pg.port}"
        settings = Settings(dsn=f"postgresql://postgres@{hosts}/postgres", connect_timeout=2)
        stopped_one.stop()
        before = answering(settings)
        stopped_one.start()
        after = answering(settings)

    assert other
    assert ({f"127.0.0.1,{private_pg.port}"}, 2) == (set(before), len(after))
