"""A ``celery worker`` that cannot use PostgreSQL refuses to start, saying what to fix."""

from __future__ import annotations

import pytest

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import testapp
from tests.apps.harness import DEADLINE, app_env, configure_broker_client, redis_result_backend
from tests.fixtures.procs import Procs

pytestmark = pytest.mark.acceptance

PASSWORD = "Sup3rS3cretPw"  # noqa: S105 - fake; must never be printed
EXIT_TIMEOUT = 30.0  # seconds for a worker to give up; connect_timeout is 5 s

BAD_DSNS = {
    "malformed-uri": f"postgresql://app:{PASSWORD}@[db.example/app",
    "malformed-keyword": f"host=db.example user=app password={PASSWORD} port",
    "unreachable": f"postgresql://app:{PASSWORD}@127.0.0.1:1/app",
}


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
    """A malformed or unreachable DSN fails start-up naming pglock_dsn, never the password."""
    env = app_env(pg_dsn=dsn, schema=pglock_schema, broker_url=redis_url)

    status, output = start_and_wait_for_exit(procs, env)

    assert status != 0
    assert "pglock_dsn" in output
    assert PASSWORD not in output
    assert " ready." not in output


def test_missing_tables_without_auto_migrate_stop_worker_naming_migrate(
    pg_dsn: str, pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """pglock_auto_migrate=False on an empty schema fails start-up naming the migrate command."""
    env = app_env(pg_dsn=pg_dsn, schema=pglock_schema, broker_url=redis_url, TEST_AUTO_MIGRATE="0")

    status, output = start_and_wait_for_exit(procs, env)

    assert status != 0
    assert "celery -A proj pglock migrate" in output
    assert " ready." not in output


def test_in_test_mode_a_worker_needs_no_postgresql(
    pglock_schema: str, redis_url: str, procs: Procs
) -> None:
    """``pglock_enabled = False``: the worker starts although the DSN leads nowhere, says
    once that nothing is locked, and runs every message of a slot."""
    env = app_env(
        pg_dsn=BAD_DSNS["unreachable"],
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

    assert status != 0
    assert "target_session_attrs=read-write" in output
    assert "ReadOnlySqlTransaction" not in output
