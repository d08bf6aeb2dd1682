"""Eager calls and ``apply_async`` options of a locked task, on a real PostgreSQL.

An in-process app (in-memory broker, eager mode where it matters): what a user's own
code and unit tests see when they call a locked task without a worker.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery

from celery_pglock import SKIPPED, ConfigurationError, PgLockTask
from celery_pglock.store._database import close_all

pytestmark = pytest.mark.integration

SLOT = "2026-12-01T07:00:00Z"


@pytest.fixture
def app(pg_dsn: str, pglock_schema: str) -> Iterator[Celery]:
    """An app with one locked task ``eager.job`` returning its argument."""
    app = Celery("eager", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
    )

    @app.task(base=PgLockTask, name="eager.job", shared=False)
    def job(value: Any = None) -> Any:
        return value

    yield app
    app.close()
    close_all()


def test_eager_reapplication_of_a_succeeded_slot_reports_skipped(app: Celery) -> None:
    """``apply()`` of a slot that already succeeded: state SKIPPED, ``get()`` the meta."""
    job = app.tasks["eager.job"]
    first = job.apply(("a",), task_id="t-1", headers={"pglock_slot": SLOT})

    again = job.apply(("b",), task_id="t-1", headers={"pglock_slot": SLOT})

    assert ("SUCCESS", "a") == (first.state, first.get())
    assert SKIPPED == again.state
    meta = again.get()
    assert ("done", SLOT, "t-1") == (meta["reason"], meta["slot"], meta["holder"]["task_id"])


@pytest.mark.parametrize("headers", [["pglock_slot", SLOT], "pglock_slot", 42])
def test_headers_that_are_not_a_mapping_count_as_none(app: Celery, headers: Any) -> None:
    """``apply(headers=...)`` takes any value; one that is not a mapping is no headers."""
    result = app.tasks["eager.job"].apply(("x",), headers=headers)

    assert ("SUCCESS", "x") == (result.state, result.get())


def test_apply_async_slot_option_is_the_message_slot(app: Celery) -> None:
    """``apply_async(pglock_slot=...)`` dedupes like the header (eager: run, then SKIPPED)."""
    app.conf.task_always_eager = True
    job = app.tasks["eager.job"]

    first = job.apply_async(("a",), pglock_slot=SLOT)
    second = job.apply_async(("b",), pglock_slot=SLOT)

    assert ("SUCCESS", "a") == (first.state, first.get())
    assert (SKIPPED, "done") == (second.state, second.get()["reason"])


def test_apply_async_slot_option_keeps_the_callers_headers(app: Celery) -> None:
    """``pglock_slot=`` is added to the headers given, it does not replace them."""
    app.conf.task_always_eager = True
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=PgLockTask, name="eager.headers", shared=False)
    def headers(self: Any) -> None:
        seen.update(self.request.headers or {})

    headers.apply_async(headers={"tenant": "t1"}, pglock_slot=SLOT)

    assert {"tenant": "t1", "pglock_slot": SLOT} == {key: seen.get(key) for key in seen}


@pytest.mark.parametrize("slot", [42, "", "x\x00y"])
def test_invalid_slot_option_fails_when_sent(app: Celery, slot: Any) -> None:
    """A ``pglock_slot=`` that is not a valid slot fails at ``apply_async``, naming it."""
    with pytest.raises(ConfigurationError, match=r"eager\.job: invalid slot"):
        app.tasks["eager.job"].apply_async(pglock_slot=slot)


def test_the_lease_is_not_a_request_attribute(app: Celery) -> None:
    """``self.pglock`` is the lease, but the request carries no ``pglock`` attribute:
    Celery copies request attributes into a retry's message, and a lease is not JSON."""
    seen: dict[str, Any] = {}

    @app.task(bind=True, base=PgLockTask, name="eager.lease", shared=False)
    def lease(self: Any) -> None:
        seen["token"] = self.pglock.token
        seen["on_request"] = "pglock" in vars(self.request)

    lease.apply(headers={"pglock_slot": SLOT})

    assert isinstance(seen["token"], int)
    assert seen["on_request"] is False


# Run in a process of its own: a worker started in-process by another test makes the
# pytest process one that serves tasks, where keeping connections is right.
OUTSIDE_A_WORKER = """
import json, os, sys, threading
import psycopg
from celery import Celery
from celery_pglock import PgLockTask

dsn, schema = sys.argv[1:3]
app = Celery("alone", set_as_current=False)
app.conf.update(broker_url="memory://", result_backend="cache+memory://", pglock_dsn=dsn,
                pglock_schema=schema, pglock_namespace=schema, pglock_lease=5)
seen = {}

@app.task(base=PgLockTask, name="alone.job", shared=False)
def job():
    seen["during"] = sorted(t.name for t in threading.enumerate())
    return os.getpid()

before = sorted(t.name for t in threading.enumerate())
results = [job.apply(headers={"pglock_slot": f"s-{n}"}).state for n in range(3)]
results.append(job.apply(headers={"pglock_slot": "s-0"}).state)  # a skip
after = sorted(t.name for t in threading.enumerate())
with psycopg.connect(dsn, autocommit=True) as conn:
    ours = conn.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
        (f"%pglock% {os.getpid()}@%",),
    ).fetchone()[0]
print(json.dumps({"results": results, "before": before, "during": seen["during"],
                  "after": after, "sessions": ours}))
"""


def test_locked_eager_calls_leave_no_thread_or_session_behind(
    pg_dsn: str, pglock_schema: str
) -> None:
    """Outside a worker, a locked call opens what it needs and closes it when it returns:
    Celery's own unit suite fails a test that leaves a thread behind, and a test
    database with a session of ours on it cannot be dropped."""
    done = subprocess.run(
        [sys.executable, "-c", OUTSIDE_A_WORKER, pg_dsn, pglock_schema],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert 0 == done.returncode, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])

    assert ["SUCCESS"] * 3 + [SKIPPED] == seen["results"]
    assert "pglock-heartbeat" in seen["during"]  # the lease was kept alive meanwhile
    assert (seen["before"], 0) == (seen["after"], seen["sessions"])


def test_retrofitted_eager_calls_lock_in_an_app_that_never_finalizes(
    pg_dsn: str, pglock_schema: str
) -> None:
    """``pglock_all_tasks`` without a worker: a plain ``@app.task`` called eagerly is
    locked though nothing finalized the app (its duplicate slot is SKIPPED)."""
    app = Celery("never_finalized", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        pglock_dsn=pg_dsn,
        pglock_schema=pglock_schema,
        pglock_namespace=pglock_schema,
        pglock_all_tasks=True,
    )

    @app.task(name="never_finalized.job", shared=False)
    def job(value: Any = None) -> Any:
        return value

    first = job.apply(("a",), headers={"pglock_slot": SLOT})
    second = job.apply(("b",), headers={"pglock_slot": SLOT})

    assert not app.finalized
    assert ("SUCCESS", "a") == (first.state, first.get())
    assert (SKIPPED, "done") == (second.state, second.get()["reason"])
    app.close()


@pytest.mark.parametrize("headers", [None, {"pglock_slot": SLOT}])
def test_a_task_calling_itself_runs_inside_its_own_lock(
    app: Celery, headers: dict[str, str] | None
) -> None:
    """A locked run that calls its own task directly (recursion) re-enters the lock it
    holds, as a session re-enters its advisory lock: the nested call is this execution,
    not a duplicate to skip."""

    @app.task(base=PgLockTask, name="eager.countdown", shared=False)
    def countdown(n: int) -> int:
        return n if n == 0 else 1 + countdown(n - 1)

    result = countdown.apply((3,), headers=headers)

    assert ("SUCCESS", 3) == (result.state, result.get())
