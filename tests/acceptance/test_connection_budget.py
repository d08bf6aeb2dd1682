"""The server's connections: a process gives back what idles, and never takes the last ones.

- A prefork fleet at rest (4 workers x 4 children, 2 beat replicas) holds only the beat
  replicas' connections once ``pglock_idle_timeout`` has passed after its last run.
- A gevent worker of concurrency 300 given 300 one-second locked tasks at once, against a
  server of its own with ``max_connections = 100``: every task succeeds once, none is
  retried, the locks share a session (at most 8 connections of the worker's), the burst
  takes at most 1.5 times plain Celery's wall time for the same tasks unlocked, ``celery
  pglock status`` runs during the burst, and the worker says at start-up how many
  connections it may hold.
- A SIGSTOPped gevent worker loses all of its locks (one shared session) within the lease,
  and another worker runs the same slots with larger fencing tokens.
- 100 tries of one lock name on one gevent (or threads) worker: two runs never overlap.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.apps import poolapp
from tests.apps.harness import WORKER_READY_TIMEOUT, configure_client, executions, redis_app_env
from tests.fixtures.measurements import MEASUREMENTS
from tests.fixtures.pg import fresh_schema, started_embedded
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.acceptance

DEADLINE = 120.0  # seconds; generous, the machine runs other suites meanwhile
RETRIED = ("will be retried", "Retry in", "no PostgreSQL connection within")
IDLE_TIMEOUT = 2.0  # the test's pglock_idle_timeout (default 30 s)
OURS = (
    "SELECT application_name FROM pg_stat_activity "
    "WHERE application_name LIKE 'celery-pglock%' OR application_name LIKE 'pglock %'"
)
PID = re.compile(r"(?:celery-pglock[^ ]*(?: beat (?:leader|standby))? |pglock )(\d+)")


def library_connections(dsn: str) -> list[tuple[str, int]]:
    """(application_name, pid) of every session of the library on the server now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        names = [row[0] for row in conn.execute(OURS).fetchall()]
    found = []
    for name in names:
        match = PID.match(name)
        found.append((name, int(match.group(1)) if match else -1))
    return found


def start_worker(
    procs: Procs,
    env: dict[str, str],
    pool: str,
    concurrency: int,
    node: str,
    *,
    queue: str | None = None,
) -> Proc:
    proc = procs.celery(
        "tests.apps.poolapp",
        "worker",
        *("-P", pool, "-c", str(concurrency), "-n", f"{node}@%h"),
        *("--without-gossip", "--without-mingle", "--without-heartbeat"),
        *("-l", "info", "-Q", queue or env["TEST_QUEUE"]),
        env=env,
        name=node,
    )
    proc.wait_for_log(" ready.", timeout=WORKER_READY_TIMEOUT)
    return proc


def retried(proc: Proc) -> list[str]:
    return [line for line in proc.log_text().splitlines() if any(s in line for s in RETRIED)]


def ledger(dsn: str, schema: str) -> list[tuple[str, str, int]]:
    """(slot, state, attempts) of every run the ledger recorded."""
    query = sql.SQL("SELECT slot, state, attempts FROM {}.pglock_runs ORDER BY slot")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(query.format(sql.Identifier(schema)))]


def test_a_prefork_fleet_at_rest_holds_only_the_beat_replicas_connections(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """4 prefork workers x 4 children run 40 locked slots; after the idle time none of
    them holds a library connection, only the 2 beat replicas do."""
    conf = {"pglock_idle_timeout": IDLE_TIMEOUT}
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
        TEST_PGLOCK_CONF=json.dumps(conf),
        TEST_BEAT_EVERY="3600",  # the replicas elect a leader; no slot of theirs falls due
    )
    configure_client(env)
    poolapp.app.conf.update(conf)
    beats = [
        procs.celery("tests.apps.poolapp", "beat", "--loglevel=INFO", env=env, name=f"beat{i}")
        for i in range(2)
    ]
    workers = [start_worker(procs, env, "prefork", 4, f"fleet{i}") for i in range(4)]

    with Peak(pg_dsn) as peak:
        results = [
            poolapp.burst.apply_async((f"{pglock_schema}:slot{i:02d}",), {"seconds": 0.5})
            for i in range(40)
        ]
        tokens = [result.get(timeout=DEADLINE) for result in results]
    worker_pids = {int(row[1]) for row in _runs_pids(pg_dsn, pglock_schema)}

    assert all(isinstance(token, int) for token in tokens)
    assert [("succeeded", 1)] * 40 == [(state, n) for _, state, n in ledger(pg_dsn, pglock_schema)]
    assert len(worker_pids) > 1, "the runs were spread over the children"
    assert set(peak.per_pid) & worker_pids, "the children held connections"
    beat_pids = {proc.pid for proc in beats}
    # The server is shared with tests running beside this one: only this fleet's own
    # processes (workers and their children) are looked at.
    fleet = {pid for w in workers for pid in (w.pid, *w.descendants())}

    def fleet_holds_none() -> bool:
        return not {pid for _, pid in library_connections(pg_dsn)} & fleet

    wait_until(
        fleet_holds_none,
        timeout=IDLE_TIMEOUT * 10 + 30,
        interval=0.5,
        message="the workers' idle connections closed",
    )
    held = {pid for _, pid in library_connections(pg_dsn)}
    assert beat_pids & held, "the beat replicas hold their election connections"
    assert [] == [line for w in workers for line in retried(w)]


def _runs_pids(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT slot, pid FROM {}.pglock_runs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return list(conn.execute(query.format(sql.Identifier(schema))).fetchall())


@pytest.fixture
def small_pg() -> Iterator[EmbeddedPostgres]:
    """A server of the test's own with the stock ``max_connections = 100``."""
    with started_embedded() as server:
        server.set_config(max_connections=100)
        server.restart()
        yield server


class Peak:
    """Samples the library's connections on ``dsn`` until stopped: the peak, per pid."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.peak = 0
        self.per_pid: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                names = [row[0] for row in conn.execute(OURS).fetchall()]
                self.peak = max(self.peak, len(names))
                counts: dict[int, int] = {}
                for name in names:
                    match = PID.match(name)
                    pid = int(match.group(1)) if match else -1
                    counts[pid] = counts.get(pid, 0) + 1
                for pid, count in counts.items():
                    self.per_pid[pid] = max(self.per_pid.get(pid, 0), count)


def running(dsn: str, schema: str) -> int:
    """How many runs the ledger shows ``running`` now."""
    query = sql.SQL("SELECT count(*) FROM {}.pglock_runs WHERE state = 'running'")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return int(conn.execute(query.format(sql.Identifier(schema))).fetchone()[0])


@pytest.mark.serial  # 300 tasks at once on a private server: heavy, so alone
def test_gevent_300_locked_tasks_at_once_on_a_server_of_100_connections(
    redis_url: str, small_pg: EmbeddedPostgres, procs: Procs
) -> None:
    """300 one-second locked tasks on gevent -c 300, max_connections = 100: all succeed
    once, none retried, at most 8 connections of the worker's (the locks share a
    session), ``pglock status`` works meanwhile. Its wall time beside plain Celery's is a
    benchmark figure (docs/benchmarks.md §12, ``python -m benchmarks.budget``), not asserted."""
    dsn = small_pg.dsn
    with fresh_schema(dsn) as schema:
        env = redis_app_env(pg_dsn=dsn, schema=schema, redis_url=redis_url)
        configure_client(env)
        worker = start_worker(procs, env, "gevent", 300, "burst")
        [line] = [x for x in worker.log_text().splitlines() if "opens at most" in x]
        with Peak(dsn) as peak:
            results = [
                poolapp.burst.apply_async((f"k{i:03d}",), {"seconds": 1.0}) for i in range(300)
            ]
            wait_until(
                lambda: running(dsn, schema) >= 50,
                timeout=DEADLINE,
                interval=0.05,
                message="the burst to hold locks",
            )
            status = subprocess.run(
                [sys.executable, "-m", "celery", "-A", "tests.apps.poolapp", "pglock", "status"],
                env={**os.environ, **env},
                capture_output=True,
                text=True,
                timeout=DEADLINE,
                check=False,
            )
            tokens = [result.get(timeout=DEADLINE) for result in results]

        assert 0 == status.returncode, status.stdout + status.stderr
        assert all(isinstance(token, int) for token in tokens)
        assert [("succeeded", 1)] * 300 == [(state, n) for _, state, n in ledger(dsn, schema)]
        assert [] == retried(worker)
        assert "301 PostgreSQL connections" in line  # the cap said at start-up
        assert "one shared session" in line
        assert "leaves the server's last 5 free slots to other clients when connected" in line
        assert 0 < peak.per_pid.get(worker.pid, 0) <= 8, peak.per_pid
        assert "too many clients" not in worker.log_text()


def test_a_frozen_gevent_worker_loses_every_lock_within_the_lease(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """A gevent worker holding 20 locks on its shared session is SIGSTOPped: the server
    ends the session when the lease runs out, freeing all 20; another worker runs the
    same slots with larger tokens."""
    lease = 2.0
    conf = {"pglock_lease": lease}
    env = redis_app_env(
        pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url, TEST_PGLOCK_CONF=json.dumps(conf)
    )
    configure_client(env)
    poolapp.app.conf.update(conf)
    frozen_queue, other_queue = f"{env['TEST_QUEUE']}-a", f"{env['TEST_QUEUE']}-b"
    frozen = start_worker(procs, env, "gevent", 50, "frozen", queue=frozen_queue)
    start_worker(procs, env, "gevent", 50, "other", queue=other_queue)
    keys = [f"{pglock_schema}:f{i:02d}" for i in range(20)]
    for key in keys:  # held far longer than the test
        poolapp.burst.apply_async((key,), {"seconds": 600.0}, queue=frozen_queue)
    wait_until(lambda: running(pg_dsn, pglock_schema) == 20, timeout=DEADLINE, message="held")
    before = dict(_tokens(pg_dsn, pglock_schema))
    # The 20 locks on one session (the worker's only connection: a lock's run opens none).
    assert 1 == len([pid for _, pid in library_connections(pg_dsn) if pid == frozen.pid])

    frozen.freeze()
    stopped = time.monotonic()
    try:
        wait_until(
            lambda: frozen.pid not in {pid for _, pid in library_connections(pg_dsn)},
            timeout=lease * 10,
            interval=0.1,
            message="the frozen worker's session ended",
        )
        freed = time.monotonic() - stopped
        results = [
            poolapp.burst.apply_async((key,), {"seconds": 0.1}, queue=other_queue) for key in keys
        ]
        tokens = [result.get(timeout=DEADLINE) for result in results]
    finally:
        frozen.thaw()

    MEASUREMENTS["frozen gevent worker: its 20 locks freed after SIGSTOP (lease 2 s)"] = freed
    assert all(token > before[key] for key, token in zip(keys, tokens, strict=True))
    after = dict(_tokens(pg_dsn, pglock_schema))
    assert dict.fromkeys(keys, "succeeded") == dict(_states(pg_dsn, pglock_schema))
    assert all(after[key] > before[key] for key in keys)


def _tokens(dsn: str, schema: str) -> list[tuple[str, int]]:
    query = sql.SQL("SELECT slot, token FROM {}.pglock_runs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(query.format(sql.Identifier(schema)))]


def _states(dsn: str, schema: str) -> list[tuple[str, str]]:
    query = sql.SQL("SELECT slot, state FROM {}.pglock_runs")
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [tuple(row) for row in conn.execute(query.format(sql.Identifier(schema)))]


@pytest.mark.parametrize("pool", ["gevent", "threads"])
def test_two_runs_of_one_lock_name_in_one_process_never_overlap(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs, pool: str
) -> None:
    """100 tries of one lock name on one worker of concurrency 20, ten at once: the runs
    that got the lock never overlap (their session would grant it to each of them; the
    process keeps them apart), the others are skipped, and tokens grow run after run."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    start_worker(procs, env, pool, 20, f"one-{pool}")
    results = []
    for _ in range(10):
        # A lock name of this test's own: advisory locks are server-wide, and the test's
        # other parameter may run at the same time.
        name = f"{pglock_schema}:same"
        wave = [poolapp.hold.apply_async((name,), {"seconds": 0.05}) for _ in range(10)]
        wait_until(
            lambda wave=wave: all(r.state in {"SUCCESS", "SKIPPED"} for r in wave),
            timeout=DEADLINE,
            message="a wave of tries to end",
        )
        results.extend(wave)

    runs = sorted(executions(pg_dsn, pglock_schema), key=lambda row: row["started"])
    assert 100 == len(results)
    assert len(runs) == sum(r.state == "SUCCESS" for r in results) >= 10
    assert all(row["finished"] is not None for row in runs)
    for before, after in itertools.pairwise(runs):
        assert before["finished"] <= after["started"], (before, after)
        assert before["token"] < after["token"]
