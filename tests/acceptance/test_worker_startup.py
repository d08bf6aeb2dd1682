"""A ``celery worker`` that cannot use PostgreSQL because of its configuration refuses to
start, in one line saying what to fix (exit status 1, nothing retried); one that cannot
reach it waits (tests/acceptance/test_startup_outage.py), unless told not to."""

from __future__ import annotations

import json
import re

import pytest
from psycopg.conninfo import make_conninfo

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import testapp
from tests.apps.harness import DEADLINE, app_env, configure_broker_client, redis_result_backend
from tests.fixtures.pg import ROLE_PASSWORD, require_password
from tests.fixtures.procs import Procs

pytestmark = pytest.mark.acceptance

PASSWORD = ROLE_PASSWORD  # the role fixture's: must never be printed
EXIT_TIMEOUT = 30.0  # seconds for a worker to give up (a loaded machine); it takes ~3
UNREACHABLE = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"
WAITING = "is waiting for PostgreSQL"

BAD_DSNS = {
    "malformed-uri": f"postgresql://app:{PASSWORD}@[db.example/app",
    "malformed-keyword": f"host=db.example user=app password={PASSWORD} port",
}


def stopped_at_once(status: int, output: str) -> bool:
    """Exit status 1, one line saying why, no traceback, no attempt retried, never ready."""
    lines = [line for line in output.splitlines() if "cannot start:" in line]
    clean = "Traceback" not in output and WAITING not in output and " ready." not in output
    return status == 1 and len(lines) == 1 and clean


def start_and_wait_for_exit(procs: Procs, env: dict[str, str]) -> tuple[int, str]:
    worker = procs.celery(
        "tests.apps.testapp",
        "worker",
        *("-P", "prefork", "-c", "1", "--without-gossip", "--without-mingle"),
        *("--without-heartbeat", "-l", "info", "-Q", env["TEST_QUEUE"]),
        env=env,
    )
    return worker.wait(timeout=EXIT_TIMEOUT), worker.log_text()


@pytest.mark.parametrize("dsn", BAD_DSNS.values(), ids=BAD_DSNS.keys())
def test_bad_dsn_stops_worker_naming_setting_without_password(
    dsn: str, pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """A malformed DSN stops the worker at once naming pglock_dsn, never the password."""
    env = app_env(pg_dsn=dsn, schema=pglock_schema, broker_url=redis_url)

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert "pglock_dsn" in output
    assert PASSWORD not in output


MISCONFIGURED = {  # what the DSN gets wrong -> (libpq options, what the line says)
    "unknown-database": ({"dbname": "no_such_db"}, "check the database name in pglock_dsn"),
    "unknown-role": ({"user": "no_such_role"}, "check the user name in pglock_dsn"),
    "schema-privileges": ({"user": "{role}"}, "grant the role USAGE and CREATE on the schema"),
}


@pytest.mark.parametrize("case", MISCONFIGURED.values(), ids=MISCONFIGURED.keys())
def test_a_misconfigured_database_stops_the_worker_naming_the_fix(
    case: tuple[dict[str, str], str],
    *,
    pg_dsn: str,
    pglock_schema: str,
    role: str,
    redis_url: str,
    procs: Procs,
) -> None:
    """An unknown database or role, a role that may not create our tables: the worker
    stops at once (exit 1, one line naming the fix, no attempt retried)."""
    options, says = case
    options = {key: value.format(role=role) for key, value in options.items()}
    dsn = make_conninfo(pg_dsn, password=PASSWORD, **options)
    env = app_env(pg_dsn=dsn, schema=pglock_schema, broker_url=redis_url)

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert says in output
    assert PASSWORD not in output


def test_a_wrong_password_stops_the_worker_naming_the_fix(
    private_pg: EmbeddedPostgres, redis_url: str, procs: Procs
) -> None:
    """Password authentication failed: the worker stops at once, naming the password
    setting, never printing a password."""
    require_password(private_pg, "app", PASSWORD)
    dsn = f"postgresql://app:{PASSWORD}x@127.0.0.1:{private_pg.port}/postgres"
    env = app_env(pg_dsn=dsn, schema="public", broker_url=redis_url)

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert "check the password in pglock_dsn" in output
    assert PASSWORD not in output


def test_missing_tables_without_auto_migrate_stop_worker_naming_migrate(
    pg_dsn: str, pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """pglock_auto_migrate=False on an empty schema fails start-up naming the migrate command."""
    env = app_env(pg_dsn=pg_dsn, schema=pglock_schema, broker_url=redis_url, TEST_AUTO_MIGRATE="0")

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert "celery -A proj pglock migrate" in output


def test_without_retry_on_startup_an_unreachable_server_stops_the_worker(
    pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """pglock_connection_retry_on_startup = False: the first failed attempt stops the
    worker, naming the setting (Celery's broker_connection_retry_on_startup, alike)."""
    conf = json.dumps({"pglock_connection_retry_on_startup": False})
    env = app_env(pg_dsn=UNREACHABLE, schema=pglock_schema, broker_url=redis_url)
    env["TEST_PGLOCK_CONF"] = conf

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert "pglock_connection_retry_on_startup" in output
    assert PASSWORD not in output


def test_max_retries_bounds_the_wait_for_an_unreachable_server(
    pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """pglock_connection_max_retries = 2: two WARNINGs (next in 1 s, next in 2 s), then
    the third failure stops the worker with one line, exit status 1, no traceback."""
    env = app_env(pg_dsn=UNREACHABLE, schema=pglock_schema, broker_url=redis_url)
    env["TEST_PGLOCK_CONF"] = json.dumps({"pglock_connection_max_retries": 2})

    status, output = start_and_wait_for_exit(procs, env)
    waited = [line for line in output.splitlines() if WAITING in line]

    assert (1, 2) == (status, len(waited)), output
    assert ["1", "2"] == [re.findall(r"next in (\d+) s", line)[0] for line in waited]
    assert "gave up after 3 attempts" in output
    assert "Traceback" not in output


def test_in_test_mode_a_worker_needs_no_postgresql(
    pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """``pglock_enabled = False``: the worker starts although the DSN leads nowhere, says
    once that nothing is locked, and runs every message of a slot."""
    env = app_env(
        pg_dsn=UNREACHABLE,
        schema=pglock_schema,
        broker_url=redis_url,
        backend_url=redis_result_backend(redis_url),
        TEST_PGLOCK_ENABLED="0",
    )
    configure_broker_client(env)
    worker = procs.celery(
        "tests.apps.testapp",
        "worker",
        *("-P", "solo", "--without-gossip", "--without-mingle", "--without-heartbeat"),
        *("-l", "info", "-Q", env["TEST_QUEUE"]),
        env=env,
    )
    worker.wait_for_log(" ready.", timeout=DEADLINE)

    results = [testapp.echo.apply_async((n,), headers={"pglock_slot": "s"}) for n in range(2)]

    assert [0, 1] == [result.get(timeout=DEADLINE) for result in results]
    assert 1 == worker.log_text().count("celery-pglock is off (pglock_enabled = False)")


def test_a_read_only_server_stops_the_worker_naming_target_session_attrs(
    private_pg: EmbeddedPostgres, pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """A DSN that reaches a standby (here: default_transaction_read_only) fails start-up
    with the fix named, not a driver traceback."""
    private_pg.set_config(default_transaction_read_only="on")
    env = app_env(pg_dsn=private_pg.dsn, schema=pglock_schema, broker_url=redis_url)

    status, output = start_and_wait_for_exit(procs, env)

    assert stopped_at_once(status, output), output
    assert "target_session_attrs=read-write" in output
    assert "ReadOnlySqlTransaction" not in output


def test_a_worker_waiting_for_postgresql_stops_on_sigterm(
    pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """SIGTERM while the worker waits for PostgreSQL: a warm shutdown, exit status 0."""
    env = app_env(pg_dsn=UNREACHABLE, schema=pglock_schema, broker_url=redis_url)
    worker = procs.celery(
        "tests.apps.testapp",
        "worker",
        *("-P", "prefork", "-c", "1", "--without-gossip", "--without-mingle"),
        *("--without-heartbeat", "-l", "info", "-Q", env["TEST_QUEUE"]),
        env=env,
    )
    worker.wait_for_log(WAITING, timeout=EXIT_TIMEOUT)

    worker.terminate()

    assert 0 == worker.wait(timeout=EXIT_TIMEOUT), worker.log_text()
    assert "Traceback" not in worker.log_text()
