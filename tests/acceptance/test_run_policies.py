"""Run policies on real workers: ``pglock_overlap = "buffer_one"`` and ``pglock_concurrency``.

Gated tasks (``harness.Gate``) hold a run until the test lets it end, so each test decides
what overlaps. Every test has its own schema, queue and lock namespace.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import datetime
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock import SKIPPED, WAITING
from celery_pglock._waiting import WAITED_HEADER
from tests.apps import testapp
from tests.apps.harness import (
    DEADLINE,
    Gate,
    configure_client,
    executions,
    ledger,
    redis_app_env,
    start_workers,
)
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

APP = "tests.apps.testapp"


def slot(n: int) -> dict[str, Any]:
    """The headers of a message of time slot ``n`` (minutes after a fixed hour)."""
    return {"pglock_slot": f"2026-11-29T18:{n:02d}:00Z"}


def state_is(result: AsyncResult[Any], state: str) -> None:
    wait_until(
        lambda: result.state == state,
        timeout=DEADLINE,
        interval=0.1,
        message=f"{result.id} to be {state}",
    )


def waiting_rows(dsn: str, schema: str) -> list[dict[str, Any]]:
    query = sql.SQL("SELECT * FROM {} ORDER BY waiting_since").format(
        sql.Identifier(schema, "pglock_waiting")
    )
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        return conn.execute(query).fetchall()


def status_text(env: dict[str, str]) -> str:
    argv = [sys.executable, "-m", "celery", "-A", APP, "pglock", "status"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False, timeout=60)
    assert 0 == done.returncode, done.stderr
    return done.stdout


def one_runs_one_waits(
    gate: Gate, dsn: str, schema: str
) -> tuple[dict[str, Any], AsyncResult[Any]]:
    """Slot 0 of ``gated_buffered`` runs, held at ``gate``; slot 1 arrives and waits:
    slot 0's execution row and slot 1's result."""
    task = testapp.gated_buffered
    task.apply_async((gate.id,), headers=slot(0))
    [run] = wait_until(lambda: executions(dsn, schema), timeout=DEADLINE, message="slot 0")
    waiting = task.apply_async((gate.id,), headers=slot(1))
    state_is(waiting, WAITING)
    return run, waiting


def most_at_once(runs: list[dict[str, Any]]) -> int:
    """The most executions that overlapped in time (started before another finished)."""
    edges: list[tuple[datetime, int]] = []
    for run in runs:
        edges += [(run["started"], 1), (run["finished"], -1)]
    at_once = peak = 0
    for _, step in sorted(edges, key=lambda edge: (edge[0], edge[1])):
        at_once += step
        peak = max(peak, at_once)
    return peak


def test_buffer_one_keeps_the_newest_slot_and_runs_it_after_the_holder(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """Slot 0 runs; 1, 2 and 3 arrive in turn: each waits and supersedes the one before,
    on a worker whose one other process stays free; once 0 ends, 3 runs, once."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    start_workers(procs, env, 1, concurrency=2)  # one process holds, one takes the others
    task = testapp.gated_buffered

    with Gate(pg_dsn) as gate:
        first = task.apply_async((gate.id,), headers=slot(0))
        wait_until(lambda: executions(pg_dsn, pglock_schema), timeout=DEADLINE, message="slot 0")
        later = []
        for n in (1, 2, 3):
            later.append(task.apply_async((gate.id,), headers=slot(n)))
            state_is(later[-1], WAITING)
        status = status_text(env)
        [kept] = waiting_rows(pg_dsn, pglock_schema)
        assert [SKIPPED, SKIPPED, WAITING] == [r.state for r in later]
    first.get(timeout=DEADLINE)
    later[-1].get(timeout=DEADLINE)

    assert (slot(3)["pglock_slot"], later[-1].id) == (kept["slot"], kept["task_id"])
    assert "WAITING SLOTS (1)" in status
    assert kept["slot"] in status
    for skipped, newer in ((later[0], later[1]), (later[1], later[2])):
        meta = skipped.result
        assert ("superseded", newer.id) == (meta["reason"], meta["holder"]["task_id"])
    ran = executions(pg_dsn, pglock_schema)
    assert [slot(0)["pglock_slot"], slot(3)["pglock_slot"]] == [r["slot"] for r in ran]
    assert ran[0]["finished"] <= ran[1]["started"]
    states = {row["slot"]: (row["state"], row["reason"]) for row in ledger(pg_dsn, pglock_schema)}
    assert {
        slot(0)["pglock_slot"]: ("succeeded", None),
        slot(1)["pglock_slot"]: ("skipped", "superseded"),
        slot(2)["pglock_slot"]: ("skipped", "superseded"),
        slot(3)["pglock_slot"]: ("succeeded", None),
    } == states
    assert [] == waiting_rows(pg_dsn, pglock_schema)


def test_a_copy_of_a_slot_its_own_message_runs_leaves_its_result_alone(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """D6 (chaos seed 8383). A waiting slot's message may take the lock itself while the
    holder, just freed, sends its copy (same task id, ``pglock_waited``): the copy then
    finds the slot run by that very task id. Its skip must not make the caller's result
    SKIPPED (ready) while the run goes on; the run's SUCCESS is what the caller gets."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    [worker] = start_workers(procs, env, 1, concurrency=2)
    task = testapp.gated_buffered

    with Gate(pg_dsn) as gate:
        ran = task.apply_async((gate.id,), headers=slot(1))
        wait_until(lambda: executions(pg_dsn, pglock_schema), timeout=DEADLINE, message="run")
        task.apply_async(  # what the holder's send_next publishes
            (gate.id,), task_id=ran.id, headers={**slot(1), WAITED_HEADER: True}
        )
        wait_until(
            lambda: f"{task.name}[{ran.id}]: locked" in worker.log_text(),
            timeout=DEADLINE,
            message="the copy skipped as locked",
        )
        during = AsyncResult(ran.id, app=testapp.app).state
    token = ran.get(timeout=DEADLINE)

    assert SKIPPED != during
    assert [token] == [row["token"] for row in executions(pg_dsn, pglock_schema)]


def test_a_waiting_slot_outlives_the_worker_that_received_it(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """The worker that received the waiting slot is SIGKILLed: the slot runs anyway, sent
    again by the holder on another worker when it ends."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url, TEST_ACKS_LATE=1)
    configure_client(env)
    holder_worker, other = start_workers(procs, env, 2, concurrency=1)

    with Gate(pg_dsn) as gate:
        run, waiting = one_runs_one_waits(gate, pg_dsn, pglock_schema)
        holder, receiver = (holder_worker, other)
        if run["pid"] not in holder.children():
            holder, receiver = receiver, holder
        receiver.kill()
    waiting.get(timeout=DEADLINE)

    ran = executions(pg_dsn, pglock_schema)
    assert [slot(0)["pglock_slot"], slot(1)["pglock_slot"]] == [r["slot"] for r in ran]
    assert ran[1]["pid"] in holder.children()


def test_the_beat_leader_sends_a_waiting_slot_whose_holder_died(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """The holder's pool process is SIGKILLed while a slot waits (no redelivery: acks
    early): nobody is left to send it but the beat leader's sweep, which does."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    [worker] = start_workers(procs, env, 1, concurrency=2)
    procs.celery(APP, "beat", "-l", "info", env=env, name="beat")

    with Gate(pg_dsn) as gate:
        run, waiting = one_runs_one_waits(gate, pg_dsn, pglock_schema)
        assert run["pid"] in worker.children()
        os.kill(run["pid"], signal.SIGKILL)  # the holder's pool process, as the OOM killer
        gate.open()
        waiting.get(timeout=DEADLINE)

    ran = executions(pg_dsn, pglock_schema)
    assert [slot(0)["pglock_slot"], slot(1)["pglock_slot"]] == [r["slot"] for r in ran]
    assert [] == waiting_rows(pg_dsn, pglock_schema)


def test_a_three_second_task_every_second_runs_each_slot_after_its_predecessor(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """Beat sends a 3 s buffer_one task every second to 2 workers x 2 processes, then
    stops: never two runs at once, no slot twice, each slot ran (after the one before it)
    or was superseded, and the last slot sent ran."""
    env = redis_app_env(
        pg_dsn=pg_dsn,
        schema=pglock_schema,
        redis_url=redis_url,
        TEST_BEAT_EVERY="1",
        TEST_BEAT_TASK="testapp.buffered_tick",
        TEST_SLOW_TICK="3",
    )
    configure_client(env)
    start_workers(procs, env, 2, concurrency=2)
    beat = procs.celery(APP, "beat", "-l", "info", env=env, name="beat")
    wait_until(
        lambda: len(executions(pg_dsn, pglock_schema)) >= 3,
        timeout=60,
        message="3 runs of the 3 s task",
    )
    beat.stop()
    rows = wait_until(
        lambda: settled(pg_dsn, pglock_schema), timeout=DEADLINE, message="the last slot"
    )

    sent = [row for row in rows if row["state"] != "scheduled"]  # claimed, maybe not sent
    assert all(row["slot"] > sent[-1]["slot"] for row in rows if row["state"] == "scheduled")
    outcomes = {(row["state"], row["reason"]) for row in sent}
    assert outcomes <= {("succeeded", None), ("skipped", "superseded")}, outcomes
    assert "succeeded" == sent[-1]["state"]  # the last slot always runs
    ran = executions(pg_dsn, pglock_schema)
    assert 1 == most_at_once(ran)
    slots = [run["slot"] for run in ran]
    assert sorted(set(slots)) == slots  # once each, each after the slot before it
    assert [r["slot"] for r in sent if r["state"] == "succeeded"] == slots
    print(f"{len(sent)} slots sent: {len(slots)} ran, {len(sent) - len(slots)} superseded")


def settled(dsn: str, schema: str) -> list[dict[str, Any]]:
    """The ledger rows once nothing runs or waits any more, oldest first; else []."""
    rows = sorted(ledger(dsn, schema), key=lambda row: row["slot"])
    busy = [row for row in rows if row["state"] in ("running", "waiting")]
    return [] if busy or waiting_rows(dsn, schema) or not rows else rows


@pytest.mark.parametrize("task_name", ["gated_limited", "gated_limited_tx"])
def test_concurrency_three_runs_three_of_ten_slots_at_once(
    task_name: str, redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """Ten slots at once, pglock_concurrency = 3: three run together, seven skip `locked`;
    status shows the three holders; each slot ran once."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    start_workers(procs, env, 1, concurrency=10)
    task = getattr(testapp, task_name)

    with Gate(pg_dsn) as gate:
        results = [task.apply_async((gate.id,), headers=slot(n)) for n in range(10)]
        wait_until(
            lambda: [r.state for r in results].count(SKIPPED) == 7,
            timeout=DEADLINE,
            interval=0.2,
            message="7 of 10 SKIPPED",
        )
        status = status_text(env)
    ran = [r for r in results if r.state != SKIPPED]
    tokens = [r.get(timeout=DEADLINE) for r in ran]

    assert {"locked"} == {r.result["reason"] for r in results if r.state == SKIPPED}
    assert 3 == len(set(tokens))
    assert 3 == status.count("3 of 3"), status  # in transaction scope too: no row yet
    rows = executions(pg_dsn, pglock_schema)
    if task_name == "gated_limited":
        assert 3 == most_at_once(rows)
    assert sorted(r.id for r in ran) == sorted(row["task_id"] for row in rows)


def test_concurrency_with_buffer_one_runs_the_waiting_slot_when_one_of_three_ends(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """Three run, the newest of the rest waits, the others are superseded; the waiting one
    runs when a key is freed."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    start_workers(procs, env, 1, concurrency=4)
    task = testapp.gated_limited_buffered

    with Gate(pg_dsn) as gate:
        running = [task.apply_async((gate.id,), headers=slot(n)) for n in range(3)]
        wait_until(
            lambda: len(executions(pg_dsn, pglock_schema)) == 3, timeout=DEADLINE, message="3 runs"
        )
        later = []
        for n in (3, 4, 5):
            later.append(task.apply_async((gate.id,), headers=slot(n)))
            state_is(later[-1], WAITING)
    for result in [*running, later[-1]]:
        result.get(timeout=DEADLINE)

    assert [SKIPPED, SKIPPED] == [r.state for r in later[:2]]
    ran = sorted(row["slot"] for row in executions(pg_dsn, pglock_schema))
    assert [slot(n)["pglock_slot"] for n in (0, 1, 2, 5)] == ran


def test_an_invalid_policy_stops_the_worker_naming_the_choices(
    redis_url: str, pg_dsn: str, pglock_schema: str, procs: Procs
) -> None:
    """pglock_overlap = "queue" (not a policy): the worker refuses to start, saying which
    task and which values are valid."""
    env = redis_app_env(
        pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url, TEST_OVERLAP="queue"
    )
    worker = procs.celery(
        APP, "worker", "-P", "solo", "-l", "info", "-Q", env["TEST_QUEUE"], env=env
    )

    status = worker.wait(timeout=DEADLINE)
    output = worker.log_text()

    assert 0 != status
    assert "pglock_overlap must be 'skip'" in output
    assert "'buffer_one'" in output
    assert "testapp.work" in output
    assert " ready." not in output
