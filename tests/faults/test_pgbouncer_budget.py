"""Behind PgBouncer, the pooler's limits are the ones that count.

- The server has fewer free slots than ``pglock_spare_connections`` while PgBouncer keeps
  idle server connections: a lock taken through PgBouncer is granted (its connection may
  be one PgBouncer already had; the pooler decides the server's connections), while a
  process connecting straight to that server still leaves the last slots to others.
- PgBouncer refusing clients beyond its ``max_client_conn``: the process waits for one of
  its own connections, as for the server's ``too many clients``; no run fails. In-process
  threads on a pool, and a real ``-P threads`` worker whose transaction-scope tasks go
  through the transaction pooler: every task succeeds once, none is retried.
"""

from __future__ import annotations

import json
import time
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest

from celery_pglock._config import Settings
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.errors import ServerFull
from tests.acceptance.test_connection_budget import ledger, retried, start_worker
from tests.apps import poolapp
from tests.apps.harness import configure_client, redis_app_env
from tests.faults import pgbouncer
from tests.fixtures.pg import fresh_schema, started_embedded
from tests.fixtures.procs import Procs
from tests.integration.locking import claim, granted, open_database
from tests.integration.test_pool_budget import free_slots
from tests.integration.test_pool_handover import run_threads

pytestmark = pytest.mark.faults

POOLED = 3  # server connections each PgBouncer pool holds, idle, before the test
DEADLINE = 120.0  # seconds; generous, the machine runs other suites meanwhile


def fill_pool(dsn: str, count: int) -> None:
    """Make PgBouncer open ``count`` server connections for ``dsn``'s pool; idle after."""
    with ExitStack() as clients:
        conns = [clients.enter_context(psycopg.connect(dsn)) for _ in range(count)]
        for conn in conns:  # each in a transaction at once: each on a server connection
            conn.execute("SELECT 1")
        for conn in conns:
            conn.commit()


def test_through_pgbouncer_the_last_server_slots_are_the_poolers_to_count(
    tmp_path: Path,
) -> None:
    """Server slots left: 2, fewer than the 5 spared. Through PgBouncer (a session lock on
    session pooling, a transaction-scope lock on transaction pooling) the lock is granted
    on a server connection PgBouncer already had; straight to the server, ServerFull."""
    with started_embedded() as server:
        server.set_config(max_connections=20)  # 20 - 3 reserved for superusers: 17 for all
        server.restart()
        with (
            fresh_schema(server.dsn) as schema,
            pgbouncer.started(server.dsn, tmp_path / "pgbouncer.log") as bouncer,
            ExitStack() as others,
        ):
            direct = Settings(dsn=server.dsn, schema=schema, connect_timeout=1.0)
            with open_database(direct):  # creates the tables
                pass
            for database in ("session", "tx"):
                fill_pool(bouncer.dsn_for(database), POOLED)
            while free_slots(server.dsn) > 2:
                others.enter_context(psycopg.connect(server.dsn, autocommit=True))
            before = server_backends(server.dsn)

            for database, scope in (("session", "session"), ("tx", "transaction")):
                settings = Settings(
                    dsn=bouncer.dsn_for(database), schema=schema, connect_timeout=1.0
                )
                with open_database(settings) as db:
                    lease = granted(acquire(db, claim(f"{schema}:{database}", "s"), scope, None))
                    assert release(db, lease, SUCCEEDED).recorded
            with open_database(direct) as db, pytest.raises(ServerFull, match="spare"):
                db.getconn()

            # A look-up's closed session may still be leaving: at most as many, not equal.
            assert server_backends(server.dsn) <= before, "PgBouncer opened no new one"


def server_backends(dsn: str) -> int:
    """Client backends on the server, this look-up's own left out."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_pgbouncer_max_client_conn_is_waited_out_on_the_process_own_connections(
    pg_dsn: str, pglock_schema: str, tmp_path: Path
) -> None:
    """PgBouncer takes 3 clients; 8 threads each hold a lock 0.3 s on a pool of 8 through
    it: all run, on at most 3 connections, none fails (no retry would be burned)."""
    with pgbouncer.started(pg_dsn, tmp_path / "pgbouncer.log", max_client_conn=3) as bouncer:
        settings = Settings(
            dsn=bouncer.dsn_for("session"), schema=pglock_schema, pool_size=8, connect_timeout=2.0
        )
        with open_database(settings) as db:
            backends: set[int] = set()

            def hold(number: int) -> None:
                lease = granted(
                    acquire(db, claim(f"{pglock_schema}:job-{number}"), "session", None)
                )
                backends.add(lease.connection.info.backend_pid)
                time.sleep(0.3)
                release(db, lease, SUCCEEDED)

            errors = run_threads(8, hold)

    assert [] == errors
    assert 1 <= len(backends) <= 3


def test_a_threads_worker_behind_a_full_pgbouncer_retries_nothing(
    pg_dsn: str, pglock_schema: str, redis_url: str, procs: Procs, tmp_path: Path
) -> None:
    """``-P threads -c 20``, every task in transaction scope (the documented answer
    behind a transaction pooler: one connection per running transaction), PgBouncer
    taking 6 clients: 40 tasks at once all succeed once, on the worker's own connections
    in turns; none is retried."""
    with pgbouncer.started(pg_dsn, tmp_path / "pgbouncer.log", max_client_conn=6) as bouncer:
        conf = {"pglock_scope": "transaction"}
        env = redis_app_env(
            pg_dsn=pg_dsn,
            schema=pglock_schema,
            redis_url=redis_url,
            TEST_PGLOCK_CONF=json.dumps(conf),
        )
        configure_client(env)
        worker_env = {**env, "PGLOCK_DSN": bouncer.dsn_for("tx")}
        worker = start_worker(procs, worker_env, "threads", 20, "bounced")

        results = [
            poolapp.burst.apply_async((f"{pglock_schema}:b{i:02d}",), {"seconds": 0.3})
            for i in range(40)
        ]
        tokens = [result.get(timeout=DEADLINE) for result in results]

    assert all(isinstance(token, int) for token in tokens)
    assert [("succeeded", 1)] * 40 == [(state, n) for _, state, n in ledger(pg_dsn, pglock_schema)]
    assert [] == retried(worker)
