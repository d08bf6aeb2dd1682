"""A backlog queued while no worker ran, then one real worker (concurrency 1) drains it.

Each backlog is a run of slotted messages for one lock (the ``testapp.keyed*`` tasks lock
on the name the caller gives), queued in a given order. One worker serves them all, so
the module costs one worker start; each test reads the outcome of its own backlog.

Messages are consumed oldest first, so a backlog queued in slot order runs every slot
even with coalescing (nothing newer has succeeded or is running when each starts);
``superseded`` drops the older messages queued *behind* a newer one (redeliveries,
several workers), and ``pglock_max_lateness`` drops stale ones whatever their order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import signals as celery_signals
from celery.result import AsyncResult

from celery_pglock import SKIPPED
from celery_pglock import _config as config
from celery_pglock import _task as task
from celery_pglock._slots import format_slot
from celery_pglock.store._database import close_all
from tests.apps import testapp
from tests.apps.harness import (
    configure_client,
    executions,
    redis_app_env,
    start_workers,
)
from tests.fixtures.pg import fresh_schema
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

DEADLINE = 60.0  # seconds for the worker to start and drain every backlog
ENTRY = "backlog-entry"
AGES = [300, 240, 180, 120, 10, 0]  # seconds before queueing; pglock_max_lateness is 60


@dataclass
class Backlog:
    """One lock's queued messages, in queue order, and what became of them."""

    key: str
    slots: list[str | None]
    results: list[AsyncResult[Any]] = field(default_factory=list)

    def outcomes(self) -> list[tuple[str | None, str, str | None]]:
        """(slot, state, skip reason) per message, in queue order."""
        found = []
        for slot, result in zip(self.slots, self.results, strict=True):
            meta = result.result if result.state == SKIPPED else None
            found.append((slot, result.state, meta["reason"] if meta else None))
        return found

    def skip_meta(self) -> list[dict[str, Any]]:
        return [result.result for result in self.results if result.state == SKIPPED]


@dataclass
class Lab:
    """The backlogs, the worker that drained them, and where their effects are."""

    dsn: str
    schema: str
    procs: Procs
    now: datetime
    backlogs: dict[str, Backlog]

    @property
    def six(self) -> list[str]:
        """Six consecutive minutely slots, oldest first, the newest a minute ago."""
        return six_slots(self.now)

    @property
    def newest_first(self) -> list[str]:
        return [self.six[-1], *self.six[:-1]]

    def ran(self, name: str) -> list[str | None]:
        """Slots executed for a backlog, in execution order."""
        key = self.backlogs[name].key
        return [r["slot"] for r in executions(self.dsn, self.schema) if r["lock_name"] == key]

    def run_ids(self, name: str) -> list[str]:
        key = self.backlogs[name].key
        return [r["task_id"] for r in executions(self.dsn, self.schema) if r["lock_name"] == key]


def queue(schema: str, name: str, kind: Any, slots: list[str | None], **headers: str) -> Backlog:
    """Send one message of ``kind`` per slot, in order, on the lock ``<schema>:<name>``."""
    backlog = Backlog(f"{schema}:{name}", slots)
    for slot in slots:
        slotted = {"pglock_slot": slot, **headers} if slot else {}
        backlog.results.append(kind.apply_async((backlog.key,), headers=slotted))
    return backlog


def six_slots(now: datetime) -> list[str]:
    return [format_slot(now - timedelta(minutes=6 - n)) for n in range(6)]


def queue_all(schema: str, now: datetime) -> dict[str, Backlog]:
    beat = {"pglock_entry": ENTRY}
    six = six_slots(now)
    newest_first: list[str | None] = [six[-1], *six[:-1]]
    aged = [format_slot(now - timedelta(seconds=age)) for age in AGES]
    return {
        "in_order": queue(schema, "in_order", testapp.keyed, list(six), **beat),
        "newest_first": queue(schema, "newest_first", testapp.keyed, newest_first, **beat),
        "all": queue(schema, "all", testapp.keyed_all, newest_first, **beat),
        "late": queue(schema, "late", testapp.keyed_fresh, aged, **beat),
        "not_beat": queue(schema, "not_beat", testapp.keyed, newest_first),
        "keys": queue(schema, "keys", testapp.keyed_latest, ["batch-3", "batch-1", "batch-2"]),
        "ad_hoc": queue(schema, "ad_hoc", testapp.keyed, [None, None, None]),
    }


def drained(backlogs: dict[str, Backlog]) -> bool:
    results = [result for backlog in backlogs.values() for result in backlog.results]
    return all(result.state in {"SUCCESS", SKIPPED} for result in results)


def forget_client_settings() -> None:
    """The in-test client reads pglock settings once per app; this module has its own."""
    config._app_settings.pop(testapp.app, None)
    for registered in testapp.app.tasks.values():
        if isinstance(registered, task.PgLockMixin):
            registered._pglock_options = None


@pytest.fixture(scope="module")
def lab(pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """Every backlog queued, then one worker started and left to drain them."""
    root = tmp_path_factory.mktemp("coalesce")
    procs = Procs(root, cwd=Path.cwd())
    with fresh_schema(pg_dsn) as schema:
        env = redis_app_env(
            pg_dsn=pg_dsn,
            schema=schema,
            redis_url=redis_url,
        )
        configure_client(env)
        forget_client_settings()
        now = datetime.now(timezone.utc).replace(microsecond=0)
        backlogs = queue_all(schema, now)
        try:
            start_workers(procs, env, 1, concurrency=1)
            wait_until(lambda: drained(backlogs), timeout=DEADLINE, message="drained backlogs")
            yield Lab(pg_dsn, schema, procs, now, backlogs)
        finally:
            procs.stop_all()
            close_all()
            forget_client_settings()


@pytest.fixture
def backlogs(lab: Lab, procs: Procs) -> Iterator[Lab]:
    """The lab, its worker lent to this test so a failure's report shows the worker log."""
    procs.started.extend(lab.procs.started)
    try:
        yield lab
    finally:
        lent = set(map(id, lab.procs.started))
        procs.started[:] = [proc for proc in procs.started if id(proc) not in lent]


def test_backlog_in_slot_order_runs_every_slot(backlogs: Lab) -> None:
    """Six beat slots queued oldest first: each runs in turn (none is older than a run)."""
    assert backlogs.six == backlogs.ran("in_order")
    assert [] == backlogs.backlogs["in_order"].skip_meta()


def test_slots_queued_behind_a_newer_one_are_superseded(backlogs: Lab) -> None:
    """The newest slot first, then five older: it runs, they are SKIPPED 'superseded'."""
    backlog = backlogs.backlogs["newest_first"]
    [run_id] = backlogs.run_ids("newest_first")

    newest, older = backlogs.six[-1], backlogs.six[:-1]

    assert [newest] == backlogs.ran("newest_first")
    assert [(slot, SKIPPED, "superseded") for slot in older] == backlog.outcomes()[1:]
    for meta in backlog.skip_meta():
        assert (run_id, newest) == (meta["holder"]["task_id"], meta["holder"]["slot"])


def test_coalesce_all_runs_older_slots_after_a_newer_one(backlogs: Lab) -> None:
    """pglock_coalesce='all': the same backlog runs all six slots, in queue order."""
    assert backlogs.newest_first == backlogs.ran("all")


def test_slots_older_than_max_lateness_are_late(backlogs: Lab) -> None:
    """pglock_max_lateness=60: the four slots 2-5 min old are SKIPPED 'late', two run."""
    backlog = backlogs.backlogs["late"]

    assert backlog.slots[-2:] == backlogs.ran("late")
    assert [SKIPPED] * 4 == [state for _, state, _ in backlog.outcomes()[:4]]
    assert ["late"] * 4 == [reason for _, _, reason in backlog.outcomes()[:4]]


def test_slots_not_sent_by_beat_are_not_coalesced_by_default(backlogs: Lab) -> None:
    """Time slots without a beat entry header run in any order under the default policy."""
    assert backlogs.newest_first == backlogs.ran("not_beat")


def test_business_key_slots_are_never_superseded(backlogs: Lab) -> None:
    """With pglock_coalesce='latest', slots that are not times still all run."""
    assert ["batch-3", "batch-1", "batch-2"] == backlogs.ran("keys")


def test_messages_without_slot_all_run(backlogs: Lab) -> None:
    """Ad-hoc messages without a slot are not coalesced: each runs."""
    assert [None, None, None] == backlogs.ran("ad_hoc")


# -- pglock_check_on_enqueue, against the slots the worker ran ---------------------------


@pytest.fixture
def published() -> Iterator[list[str]]:
    """Ids of the messages this process published during the test."""
    ids: list[str] = []

    def receiver(headers: Any = None, **_: Any) -> None:
        ids.append(headers["id"])

    celery_signals.after_task_publish.connect(receiver, weak=False)
    yield ids
    celery_signals.after_task_publish.disconnect(receiver)


def test_enqueue_check_refuses_a_slot_the_worker_ran(backlogs: Lab, published: list[str]) -> None:
    """A slot that succeeded is not published; the result backend says SKIPPED 'done'."""
    key = backlogs.backlogs["in_order"].key
    [*_, run_id] = backlogs.run_ids("in_order")

    newest = backlogs.six[-1]

    sent = testapp.keyed_checked.apply_async((key,), headers={"pglock_slot": newest})
    stored = AsyncResult(sent.id, app=testapp.app)

    assert [] == published
    assert SKIPPED == stored.state
    meta = stored.get(timeout=5)
    assert ("done", newest, run_id) == (meta["reason"], meta["slot"], meta["holder"]["task_id"])


def test_enqueue_check_publishes_a_new_slot(backlogs: Lab, published: list[str]) -> None:
    """A slot not run yet is published and runs on the worker."""
    key = backlogs.backlogs["in_order"].key
    slot = format_slot(backlogs.now + timedelta(minutes=1))

    sent = testapp.keyed_checked.apply_async((key,), headers={"pglock_slot": slot})

    assert [sent.id] == published
    assert sent.get(timeout=DEADLINE) is not None  # its fencing token: it ran under the lock
