"""A ``celery worker`` that cannot use PostgreSQL refuses to start, saying what to fix."""

from __future__ import annotations

import pytest

from tests.apps.harness import app_env
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
