"""The DSN across a promotion: the CLI follows a multi-host DSN to the new primary, and a
DSN naming only the standby is refused at start-up with the fix named."""

from __future__ import annotations

import pytest

from tests.apps.harness import app_env
from tests.failover.conftest import Cluster
from tests.fixtures.procs import Procs

pytestmark = pytest.mark.failover

SCHEMA = "failover_dsn"


def test_the_cli_follows_a_multi_host_dsn_to_the_new_primary(
    cluster: Cluster, redis_url: str, procs: Procs
) -> None:
    env = app_env(pg_dsn=cluster.dsn, schema=SCHEMA, broker_url=redis_url)
    assert 0 == procs.celery("tests.apps.testapp", "pglock", "migrate", env=env).wait(60)
    cluster.fail_over()

    status = procs.celery("tests.apps.testapp", "pglock", "status", env=env, name="status")

    assert 0 == status.wait(60), status.log_text()
    assert "HELD LOCKS" in status.log_text()


def test_a_worker_given_only_the_standby_stops_naming_target_session_attrs(
    cluster: Cluster, redis_url: str, procs: Procs
) -> None:
    env = app_env(pg_dsn=cluster.replica.dsn, schema=SCHEMA, broker_url=redis_url)
    worker = procs.celery("tests.apps.testapp", "worker", "-P", "solo", env=env, name="worker")

    assert 0 != worker.wait(60)
    assert "target_session_attrs=read-write" in worker.log_text()
    assert "ReadOnlySqlTransaction" not in worker.log_text()  # ours, not the driver's


def test_a_worker_started_before_the_replica_is_promoted_waits_for_it(
    cluster: Cluster, redis_url: str, procs: Procs
) -> None:
    """The primary lost, the replica not promoted yet: a worker given the multi-host DSN
    finds no writable host (an outage, not a misconfiguration), waits, and is ready once
    the replica is promoted."""
    env = app_env(pg_dsn=cluster.dsn, schema=SCHEMA, broker_url=redis_url)
    cluster.primary.stop("immediate")
    worker = procs.celery(
        "tests.apps.testapp", "worker", "-P", "solo", "-l", "info", env=env, name="worker"
    )
    worker.wait_for_log("is waiting for PostgreSQL", timeout=60)

    cluster.replica.promote()

    worker.wait_for_log(" ready.", timeout=60)
    assert worker.alive
    assert "session is read-only" in worker.log_text()  # the reason the WARNINGs gave
    assert "PostgreSQL answers" in worker.log_text()
    assert "cannot start" not in worker.log_text()
