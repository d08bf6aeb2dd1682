"""Smoke test: one slot sent four times to a real ``celery worker`` runs once.

Self-contained on purpose: it needs only pytest, redis, Celery, psycopg and an installed
celery-pglock (no ``tests`` package, no dev-only extras, no pytest plugins), so CI runs it
unchanged from a copy of this folder against the built wheel, on the lowest and newest
supported Celery. Hence no ``__init__.py`` here: ``smokeapp`` is imported by its bare
name, from this folder, by the test and by the worker alike.

Environment: ``PGLOCK_TEST_DSN`` (PostgreSQL), ``PGLOCK_TEST_REDIS_URL`` (default
``redis://127.0.0.1:6379/0``; the result backend is database 1 of that server).
``PGLOCK_TEST_REQUIRE`` lists services whose absence fails the test instead of skipping
it (CI lists them all).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import psycopg
import pytest
import redis
import smokeapp
from psycopg import sql

pytestmark = pytest.mark.smoke

HERE = Path(__file__).resolve().parent
SLOT = "2026-12-01T00:00:00Z"
COPIES = 4
DEADLINE = 60.0  # seconds for the worker to start, and for the four results; the machine is shared
STOP_TIMEOUT = 15.0  # seconds the worker gets to exit after SIGTERM
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"

T = TypeVar("T")


def unavailable(service: str, reason: str) -> NoReturn:
    """Fail if ``PGLOCK_TEST_REQUIRE`` lists ``service``, else skip, saying why."""
    required = {name.strip() for name in os.environ.get("PGLOCK_TEST_REQUIRE", "").split(",")}
    if service in required:
        pytest.fail(
            f"{service} is unreachable but PGLOCK_TEST_REQUIRE lists it: {reason}", pytrace=False
        )
    pytest.skip(f"{service} unreachable ({reason}); PGLOCK_TEST_REQUIRE={service} makes it fail")


def wait_for(predicate: Callable[[], T], what: str, explain: Callable[[], str]) -> T:
    """Poll ``predicate`` until it returns something truthy, for at most ``DEADLINE`` seconds."""
    deadline = time.monotonic() + DEADLINE
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {DEADLINE:g}s; last: {value!r}\n{explain()}")
        time.sleep(0.1)


@pytest.fixture
def pg_dsn() -> str:
    """The PostgreSQL of ``PGLOCK_TEST_DSN``, checked to answer."""
    dsn = os.environ.get("PGLOCK_TEST_DSN", "").strip()
    if not dsn:
        unavailable("postgres", "PGLOCK_TEST_DSN is not set")
    try:
        with psycopg.connect(dsn, connect_timeout=3) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        unavailable("postgres", str(exc))
    return dsn


@pytest.fixture
def redis_url() -> str:
    """The Redis of ``PGLOCK_TEST_REDIS_URL``, checked to answer."""
    url = os.environ.get("PGLOCK_TEST_REDIS_URL", "").strip() or DEFAULT_REDIS_URL
    try:
        with redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3) as client:
            client.ping()
    except redis.RedisError as exc:
        unavailable("redis", str(exc))
    return url


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    """A fresh schema holding the ``runs`` table (and, once used, celery-pglock's tables)."""
    name = f"smoke_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id serial PRIMARY KEY, task_id text NOT NULL, slot text, "
                "pid integer NOT NULL, at timestamptz NOT NULL DEFAULT now())"
            ).format(smokeapp.runs_table(name))
        )
    try:
        yield name
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def env(pg_dsn: str, redis_url: str, schema: str) -> dict[str, str]:
    """The worker's configuration (see ``smokeapp``), also applied to this process's app."""
    config = {
        "PGLOCK_DSN": pg_dsn,
        "SMOKE_SCHEMA": schema,
        "SMOKE_BROKER_URL": redis_url,
        "SMOKE_RESULT_BACKEND": redis_url.rsplit("/", 1)[0] + "/1",
        "SMOKE_QUEUE": f"smoke-{uuid.uuid4().hex[:10]}",  # shared brokers: ours alone
    }
    smokeapp.configure(config)
    return config


class Worker:
    """A ``celery -A smokeapp worker`` in its own session, logging to a file."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.node = env["SMOKE_QUEUE"]
        self.log_path = log_path
        argv = [sys.executable, "-m", "celery", "-A", "smokeapp", "worker"]
        argv += ["-P", "prefork", "-c", "2", "-n", f"{self.node}@%h", "-Q", env["SMOKE_QUEUE"]]
        argv += ["--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"]
        path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
        full_env = {**os.environ, **env, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        with log_path.open("wb") as log:
            self.popen = subprocess.Popen(
                argv,
                cwd=HERE,  # never the source tree's root: the installed package is used
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def report(self) -> str:
        status = self.popen.poll()
        tail = "\n".join(self.log().splitlines()[-80:])
        return f"worker pid {self.popen.pid} exit status {status}; log tail:\n{tail}"

    def ready(self) -> bool:
        """Whether the worker logged Celery's ``<node> ready.``; fails if it exited."""
        if self.popen.poll() is not None:
            raise AssertionError(f"the worker exited before it was ready\n{self.report()}")
        return f"{self.node}@{socket.gethostname()} ready." in self.log()

    def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL the worker's session (its pool processes too)."""
        pid = self.popen.pid
        if self.popen.poll() is None:
            os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(STOP_TIMEOUT)
        with contextlib.suppress(ProcessLookupError):  # its session id is its pid
            os.killpg(pid, signal.SIGKILL)
        self.popen.wait()


@pytest.fixture
def worker(env: dict[str, str], tmp_path: Path) -> Iterator[Worker]:
    """A started prefork worker (2 processes) on the test's queue, stopped after the test."""
    proc = Worker(env, tmp_path / "worker.log")
    try:
        wait_for(proc.ready, "worker ready line", proc.report)
        yield proc
    finally:
        proc.stop()


def runs(dsn: str, schema: str) -> list[tuple[Any, ...]]:
    """Every recorded execution: (task_id, slot)."""
    query = sql.SQL("SELECT task_id, slot FROM {} ORDER BY id").format(smokeapp.runs_table(schema))
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query).fetchall()


def test_one_slot_sent_four_times_runs_once(
    worker: Worker, env: dict[str, str], pg_dsn: str, schema: str
) -> None:
    """One slot sent four times runs once; the other three are SKIPPED, 'done' or 'locked'."""
    headers = {"pglock_slot": SLOT}
    results = [smokeapp.record.apply_async(headers=headers) for _ in range(COPIES)]
    assert COPIES == len({result.id for result in results})

    def final_states() -> list[str]:
        found = [result.state for result in results]
        return found if all(state in ("SUCCESS", "SKIPPED") for state in found) else []

    states = wait_for(final_states, "four final states", worker.report)

    ran = [result for result in results if result.state == "SUCCESS"]
    skipped = [result for result in results if result.state == "SKIPPED"]
    assert (1, 3) == (len(ran), len(skipped)), f"{states}\n{worker.report()}"
    assert [(ran[0].id, SLOT)] == runs(pg_dsn, schema)
    assert ran[0].id == ran[0].get(timeout=DEADLINE)
    for result in skipped:
        meta = result.get(timeout=DEADLINE)  # a skip is final: get() returns its meta at once
        assert isinstance(meta, dict), meta
        assert meta.get("reason") in ("done", "locked"), meta


def test_eager_call_body_sees_its_own_request(
    env: dict[str, str], pg_dsn: str, schema: str
) -> None:
    """An eager call's body sees its task id and slot; a second call of that slot is SKIPPED."""
    headers = {"pglock_slot": SLOT}
    first = smokeapp.record.apply(task_id=f"eager-1-{schema}", headers=headers)
    again = smokeapp.record.apply(task_id=f"eager-2-{schema}", headers=headers)

    assert ("SUCCESS", first.id) == (first.state, first.result), first.traceback
    assert [(first.id, SLOT)] == runs(pg_dsn, schema)
    assert ("SKIPPED", "done") == (again.state, again.get()["reason"])
