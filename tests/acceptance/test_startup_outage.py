"""Start-up while PostgreSQL is away, with real processes (guarantee 10): beat replicas and
workers wait for it, as Celery waits for its broker, and serve once it answers; a beat
whose configuration is wrong stops at once, in one line naming the fix.

The server is a throwaway one of each test, stopped and started for real.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.faults.workload import HOSTNAME, MEASUREMENTS, Workload, log_time
from tests.fixtures.pg import require_password
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.acceptance

DOWN = 20.0  # seconds PostgreSQL stays stopped while everything starts
SLOT = "2026-11-29T18:05:00Z"
SEND_DEADLINE = 8.0  # seconds after PostgreSQL answers; a 16-s back-off step would miss it
DEADLINE = 60.0  # seconds for anything else (a loaded machine)
WAITING = "is waiting for PostgreSQL"
ANSWERS = "PostgreSQL answers"
PASSWORD = "Sup3rS3cretPw"  # noqa: S105 - fake; must never be printed


def workload(server: EmbeddedPostgres, procs: Procs, redis_url: str, **env: Any) -> Workload:
    w = Workload(
        name="startup",
        admin_dsn=server.dsn,
        app_dsn=server.dsn,
        redis_url=redis_url,
        procs=procs,
        **env,
    )
    w.prepare()
    return w


def threads_worker(w: Workload) -> Proc:
    """A ``-P threads`` worker on the workload's queue (``Workload.worker`` is prefork)."""
    queue = w.env["TEST_QUEUE"]
    node = f"threads-{queue}"
    proc = w.procs.celery(
        w.app,
        "worker",
        *("-P", "threads", "-c", "4", "-n", f"{node}@%h"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        *("-l", "info", "-Q", queue),
        env=w.env,
        name="worker-threads",
    )
    w.ready_lines[proc.pid] = f"{node}@{HOSTNAME} ready."
    w.workers.append(proc)
    return proc


def queued(redis_url: str, queue: str) -> int:
    """Messages waiting in the Redis list of ``queue`` (no priority: the list is the queue)."""
    client = redis.Redis.from_url(redis_url)
    with client:
        return int(client.llen(queue))


def first_send_after(beats: list[Proc], moment: float) -> float | None:
    """Epoch of the first slot any beat replica sent after ``moment`` (epoch)."""
    sent = [
        log_time(line)
        for proc in beats
        for line in proc.log_text().splitlines()
        if "Sending due task" in line and log_time(line) > moment
    ]
    return min(sent, default=None)


def test_beats_and_workers_started_during_an_outage_serve_once_postgresql_answers(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """PostgreSQL stopped; two beat replicas, a prefork and a threads worker start; 20 s
    later it starts: all are alive, none consumed meanwhile, the leader sends soon after
    PostgreSQL answers, a locked job succeeds; each process logged WARNINGs, no traceback."""
    w = workload(private_pg, procs, redis_url)
    private_pg.stop("fast")
    stopped = time.monotonic()
    beats = [w.beat("b1", lead=None), w.beat("b2", lead=None)]
    workers = [w.worker("prefork", wait=False), threads_worker(w)]
    everyone = beats + workers
    w.wait_for(
        lambda: all(WAITING in proc.log_text() for proc in everyone),
        timeout=DEADLINE,
        message="every process to wait for PostgreSQL",
    )
    [job] = w.send(w.key("job"), slot=SLOT)
    wait_until(lambda: time.monotonic() - stopped >= DOWN, timeout=DOWN + 1, message="outage")
    w.alive_check()
    still_queued = queued(redis_url, w.env["TEST_QUEUE"])

    private_pg.start()
    answered = time.time()
    sent_at = w.wait_for(
        lambda: first_send_after(beats, answered),
        timeout=SEND_DEADLINE,
        message="the leader to send after PostgreSQL answered",
    )
    MEASUREMENTS["startup outage: first send after PostgreSQL answered"] = round(
        sent_at - answered, 3
    )
    w.settle([job], timeout=DEADLINE)
    w.wait_for(
        lambda: all(w.worker_ready(proc) for proc in workers),
        timeout=DEADLINE,
        message="both workers ready",
    )
    # A standby beat notices at its next ping, after the leader may already have sent.
    w.wait_for(
        lambda: all(ANSWERS in proc.log_text() for proc in everyone),
        timeout=DEADLINE,
        message="every process to say PostgreSQL answers",
    )
    w.alive_check()

    assert 1 == still_queued  # nobody consumed while waiting for PostgreSQL
    assert "SUCCESS" == job.result.state
    assert [(True, True, False)] * 4 == [
        (WAITING in proc.log_text(), ANSWERS in proc.log_text(), "Traceback" in proc.log_text())
        for proc in everyone
    ]


def beat_exit(w: Workload, **env: str) -> tuple[int, str]:
    """Start a beat replica with ``env`` and wait for it to exit."""
    proc = w.beat("b", lead=None, **env)
    return proc.wait(timeout=DEADLINE), proc.log_text()


def stopped_at_once(status: int, log: str) -> bool:
    """Exit status 1, one line saying why, no traceback, no attempt retried, nothing sent."""
    lines = [line for line in log.splitlines() if "cannot start:" in line]
    quiet = "Traceback" not in log and WAITING not in log and "Sending due task" not in log
    return status == 1 and len(lines) == 1 and quiet


@pytest.mark.parametrize("leader", ["1", "0"], ids=["leader", "active-active"])
def test_a_beat_given_an_unknown_database_stops_naming_the_fix(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str, leader: str
) -> None:
    """An unknown database: beat exits 1 at once, one line naming pglock_dsn."""
    w = workload(private_pg, procs, redis_url, TEST_BEAT_LEADER=leader)
    dsn = private_pg.dsn.rsplit("/", 1)[0] + "/no_such_db"

    status, log = beat_exit(w, PGLOCK_DSN=dsn)

    assert stopped_at_once(status, log), log
    assert "check the database name in pglock_dsn" in log


def test_a_beat_given_a_read_only_server_stops_naming_target_session_attrs(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A DSN that reaches only a read-only server: beat exits 1, naming the fix."""
    w = workload(private_pg, procs, redis_url)
    private_pg.set_config(default_transaction_read_only="on")

    status, log = beat_exit(w)

    assert stopped_at_once(status, log), log
    assert "target_session_attrs=read-write" in log


def test_a_beat_given_a_wrong_password_stops_without_printing_it(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """A wrong password: beat exits 1 at once, naming the password setting, not printing it."""
    w = workload(private_pg, procs, redis_url)
    require_password(private_pg, "app", PASSWORD)
    dsn = f"postgresql://app:{PASSWORD}x@127.0.0.1:{private_pg.port}/postgres"

    status, log = beat_exit(w, PGLOCK_DSN=dsn)

    assert stopped_at_once(status, log), log
    assert "check the password in pglock_dsn" in log
    assert PASSWORD not in log


def test_a_beat_waiting_for_postgresql_stops_on_sigterm(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """SIGTERM while a beat replica waits for PostgreSQL: it exits 0, no traceback."""
    w = workload(private_pg, procs, redis_url)
    private_pg.stop("fast")
    beat = w.beat("b", lead=None)
    beat.wait_for_log(WAITING, timeout=DEADLINE)

    beat.terminate()

    assert 0 == beat.wait(timeout=DEADLINE), beat.log_text()
    assert "Traceback" not in beat.log_text()


def test_a_beat_gives_up_after_max_retries(
    private_pg: EmbeddedPostgres, procs: Procs, redis_url: str
) -> None:
    """pglock_connection_max_retries = 1: one WARNING, then beat exits 1 in one line."""
    w = workload(private_pg, procs, redis_url)
    private_pg.stop("fast")

    status, log = beat_exit(w, TEST_PGLOCK_CONF=json.dumps({"pglock_connection_max_retries": 1}))

    assert (1, 1) == (status, log.count(WAITING)), log
    assert "gave up after 2 attempts" in log
    assert "Traceback" not in log
