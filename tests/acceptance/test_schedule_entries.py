"""Schedule entries stored in PostgreSQL, changed at runtime through the CLI, as an
operator types it (``celery -A proj pglock entries …``), with three real ``celery beat``
replicas (leader election) and a worker: an added entry runs from its first boundary,
sent by one replica; an edited interval takes effect at the next slot; a removed entry
sends nothing more; a one-off runs once; an edit made while the leader is SIGKILLed is
sent by the new leader in its new form. Every slot runs exactly once."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock._slots import parse_slot
from tests.acceptance.beat_support import APP, prepared_schema
from tests.apps.harness import app_env
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.acceptance

TASK = "testapp.keyed"  # locked on its first argument: each entry its own lock
DEADLINE = 60.0
BEATS = 3


@pytest.fixture
def lab(pg_dsn: str, redis_url: str, procs: Procs) -> Iterator[dict[str, Any]]:
    with prepared_schema(pg_dsn, "t_entries") as schema:
        env = app_env(
            pg_dsn=pg_dsn,
            schema=schema,
            broker_url=redis_url,
            TEST_NAMESPACE=schema,
            TEST_BEAT_LEASE="5",
            TEST_PGLOCK_CONF=json.dumps({"pglock_beat_max_interval": 1}),
        )
        procs.celery(APP, "worker", "--pool=solo", "-l", "info", env=env, name="worker")
        beats = [
            procs.celery(APP, "beat", "-l", "info", env=env, name=f"beat{n}") for n in range(BEATS)
        ]
        yield {"env": env, "schema": schema, "dsn": pg_dsn, "beats": beats}


def cli(lab: dict[str, Any], *args: str) -> str:
    """``celery -A tests.apps.testapp pglock entries ARGS``, as typed; its output."""
    argv = [sys.executable, "-m", "celery", "-A", APP, "pglock", "entries", *args]
    done = subprocess.run(argv, env=lab["env"], capture_output=True, text=True, check=False)
    assert 0 == done.returncode, done.stderr
    return done.stdout


def key(lab: dict[str, Any], entry: str) -> str:
    """``entry``'s lock: the argument it is stored with (``testapp.keyed`` locks on it)."""
    return f"{lab['schema']}:{entry}"


def add(lab: dict[str, Any], entry: str, *schedule: str) -> None:
    cli(lab, "add", entry, "--task", TASK, "--args", json.dumps([key(lab, entry)]), *schedule)


def runs_of(lab: dict[str, Any], entry: str) -> list[str]:
    """The slots of ``entry`` the worker ran, in the order they ran."""
    query = sql.SQL("SELECT slot, lock_name FROM {} WHERE task = %s ORDER BY id").format(
        sql.Identifier(lab["schema"], "executions")
    )
    with (
        psycopg.connect(lab["dsn"], autocommit=True) as conn,
        conn.cursor(row_factory=dict_row) as cur,
    ):
        rows = cur.execute(query, [TASK]).fetchall()
    return [row["slot"] for row in rows if row["lock_name"] == key(lab, entry)]


def senders(lab: dict[str, Any], entry: str) -> Counter[str]:
    """How many replicas claimed each slot of ``entry`` (one each, or it ran twice)."""
    query = sql.SQL("SELECT slot, sent_by FROM {} WHERE entry = %s").format(
        sql.Identifier(lab["schema"], "pglock_beat_sends")
    )
    with psycopg.connect(lab["dsn"], autocommit=True) as conn:
        return Counter(slot for slot, _ in conn.execute(query, [entry]).fetchall())


def leader(lab: dict[str, Any]) -> Proc:
    found = [beat for beat in lab["beats"] if "is now the leader" in beat.log_text()]
    assert found, "no beat replica leads"
    return found[-1]


def slots_after(lab: dict[str, Any], entry: str, moment: float, every: int) -> list[str]:
    """``entry``'s slots that ran, due after ``moment`` (a time.time()), once one has;
    each must fall on a boundary of ``every`` seconds."""
    wait_until(
        lambda: any(parse_slot(s).timestamp() > moment + 1 for s in runs_of(lab, entry)),
        timeout=DEADLINE,
        message=f"a slot of {entry} after its change",
    )
    after = [s for s in runs_of(lab, entry) if parse_slot(s).timestamp() > moment + 1]
    assert all(0 == parse_slot(s).timestamp() % every for s in after), after
    return after


def test_entries_added_edited_and_removed_through_the_cli_run_each_slot_once(
    lab: dict[str, Any],
) -> None:
    """One timeline, the entries side by side: ``pulse`` added (2 s), edited (5 s),
    removed; ``steady`` (3 s) edited (4 s) while its leader is SIGKILLed; ``once`` at a
    time. Every slot runs once, claimed by one replica."""
    at = (datetime.now(timezone.utc) + timedelta(seconds=8)).replace(microsecond=0)
    add(lab, "once", "--at", at.isoformat())
    add(lab, "pulse", "--every", "2s")
    add(lab, "steady", "--every", "3s")
    wait_until(
        lambda: runs_of(lab, "pulse") and runs_of(lab, "steady"),
        timeout=DEADLINE,
        message="the added entries' first runs",
    )
    assert 0 == parse_slot(runs_of(lab, "pulse")[0]).timestamp() % 2

    cli(lab, "edit", "pulse", "--every", "5s")
    slots_after(lab, "pulse", time.time(), 5)
    listed = json.loads(cli(lab, "list", "--json"))
    assert {"pulse": {"every": 5.0}} == {
        e["name"]: e["schedule"] for e in listed if e["name"] == "pulse"
    }

    leader(lab).kill()
    cli(lab, "edit", "steady", "--every", "4s")
    edited_at = time.time()
    cli(lab, "rm", "pulse")
    removed_at = datetime.now(timezone.utc)
    slots_after(lab, "steady", edited_at, 4)  # sent by the new leader in its new form

    quiet_until = removed_at + timedelta(seconds=16)  # three intervals of 5 s, and one more
    wait_until(lambda: datetime.now(timezone.utc) > quiet_until, timeout=30, interval=0.5)
    late = [s for s in runs_of(lab, "pulse") if parse_slot(s) > removed_at + timedelta(seconds=1)]
    assert [] == late
    assert [at.strftime("%Y-%m-%dT%H:%M:%SZ")] == runs_of(lab, "once")
    for entry in ("pulse", "steady"):
        slots = runs_of(lab, entry)
        assert len(slots) == len(set(slots)), Counter(slots)  # each slot ran once
        assert {1} == set(senders(lab, entry).values())  # claimed by one replica each
