"""Only a duplicate is skipped: README's retrofit lines, as written, never drop distinct work.

A stock project with plain ``@shared_task`` tasks gets the README's three lines (or their
Django-settings form) and runs in real workers: distinct calls and distinct slots all run,
each once; only the same slot again, or the same message again, is skipped.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.acceptance.retrofit_support import (
    DEADLINE,
    DJANGO_CELERY,
    DJANGO_SETTINGS,
    Project,
    one_slot_runs_once,
    project,
    readme_project,
    users,
)
from tests.apps.harness import ledger
from tests.fixtures.procs import wait_until

__all__ = ["project"]  # the fixture

pytestmark = pytest.mark.acceptance

EIGHT_EMAILS = """
results = [tasks.send_welcome_email.delay(user) for user in range(8)]
print(json.dumps([[r.get(timeout=60), r.state] for r in results]))
"""
SIX_SLOTS = """
results = [
    tasks.send_welcome_email.apply_async((n,), pglock_slot=f"q2-{n}") for n in range(6)
]
print(json.dumps([[r.get(timeout=60), r.state] for r in results]))
"""


def django_project(project: Project) -> None:
    """The project retrofitted through Django's settings (``CELERY_PGLOCK_ALL_TASKS``)."""
    project.write("settings", DJANGO_SETTINGS)
    project.write("celery", DJANGO_CELERY)


@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_eight_welcome_emails_all_go_out_once_each(project: Project, pool: str) -> None:
    """README's lines, one plain 1-s task, eight ``.delay(user)`` on ``-c 4``: eight
    SUCCESS, each user once (under 0.1 seven were SKIPPED ``locked``)."""
    readme_project(project)
    worker = project.worker("-P", pool, "-c", "4")

    results = project.call(EIGHT_EMAILS)

    assert [[user, "SUCCESS"] for user in range(8)] == results
    assert Counter({f"user-{user}": 1 for user in range(8)}) == users(project)
    [said] = [line for line in worker.log_text().splitlines() if "celery-pglock locks" in line]
    assert "locks duplicates only (beat: one at a time per entry): " in said
    assert "proj.tasks.send_welcome_email" in said


def test_eight_welcome_emails_with_the_django_settings_form(project: Project) -> None:
    """``CELERY_PGLOCK_ALL_TASKS = True`` in Django settings: the same eight e-mails."""
    django_project(project)
    project.worker("-P", "prefork", "-c", "4")

    results = project.call(EIGHT_EMAILS)

    assert ["SUCCESS"] * 8 == [state for _, state in results]
    assert Counter({f"user-{user}": 1 for user in range(8)}) == users(project)


def test_six_distinct_slots_sent_at_once_all_run_once(project: Project) -> None:
    """Six explicit slots of one task are distinct work: all six run, each once."""
    readme_project(project)
    project.worker("-P", "prefork", "-c", "4")

    results = project.call(SIX_SLOTS)

    assert [[n, "SUCCESS"] for n in range(6)] == results
    assert Counter({f"user-{n}": 1 for n in range(6)}) == users(project)
    rows = ledger(project.env["PGLOCK_DSN"], project.env["TEST_SCHEMA"])
    assert {(f"q2-{n}", "succeeded") for n in range(6)} == {(r["slot"], r["state"]) for r in rows}


def test_one_slot_sent_four_times_at_once_runs_once(project: Project) -> None:
    """The same slot four times is one piece of work: one run, three SKIPPED."""
    readme_project(project)
    project.worker("-P", "prefork", "-c", "4")

    one_slot_runs_once(project, 4)


def test_two_beat_entries_of_one_task_both_run_every_slot(project: Project) -> None:
    """Two entries of one task, other arguments, the same schedule: distinct work, so each
    entry's every slot runs once (each entry is guarded under a lock name of its own)."""
    schedule = """
app.conf.beat_schedule = {
    "report-daily": {"task": "proj.tasks.record", "schedule": 1.0, "args": ("daily",)},
    "report-weekly": {"task": "proj.tasks.record", "schedule": 1.0, "args": ("weekly",)},
}
"""
    readme_project(project, schedule)
    project.worker("-P", "prefork", "-c", "2")
    project.beat()

    def both_ran_four_slots() -> list[dict[str, Any]]:
        rows = project.ran()
        by_slot: dict[str, set[str]] = {}
        for row in rows:
            by_slot.setdefault(row["slot"], set()).add(row["marker"])
        full = [slot for slot, markers in by_slot.items() if markers == {"daily", "weekly"}]
        return rows if len(full) >= 4 else []

    rows = wait_until(both_ran_four_slots, timeout=DEADLINE, message="4 slots of both entries")

    pairs = Counter((row["slot"], row["marker"]) for row in rows)
    assert {1} == set(pairs.values())  # no entry ran a slot twice
    locks = {r["lock_name"] for r in ledger(project.env["PGLOCK_DSN"], project.env["TEST_SCHEMA"])}
    schema = project.env["TEST_SCHEMA"]
    assert {f"{schema}:proj.tasks.record@report-{e}" for e in ("daily", "weekly")} == locks


REDELIVERY_CONF = """
app.conf.pglock_slot = "message"         # dedupe redeliveries by task id, durably
app.conf.task_acks_late = True
app.conf.task_reject_on_worker_lost = True
"""
SEND_LONG = """
result = tasks.long_first_attempt.apply_async(("finished",))
print(json.dumps(result.id))
"""
SEND_LONG_AGAIN = """
result = tasks.long_first_attempt.apply_async(("again",), task_id={task_id!r})
print(json.dumps(result.id))
"""


def test_a_redelivery_after_a_killed_worker_runs_and_a_later_copy_is_skipped(
    project: Project,
) -> None:
    """``pglock_slot = "message"``: an ``acks_late`` message whose worker process is
    SIGKILLed mid-run is delivered again and succeeds; sent again after that success (the
    same task id), it is skipped ``done``."""
    readme_project(project, REDELIVERY_CONF)
    worker = project.worker("-P", "prefork", "-c", "2")
    task_id = project.call(SEND_LONG)
    start = wait_until(
        lambda: next((r for r in project.ran() if r["marker"].startswith("start ")), None),
        timeout=DEADLINE,
        message="the first attempt started",
    )

    os.kill(int(start["marker"].split()[1]), signal.SIGKILL)

    done = wait_until(
        lambda: [r for r in project.ran() if r["marker"] == "finished"],
        timeout=DEADLINE,
        message="the redelivered message finished",
    )
    assert [task_id] == [row["task_id"] for row in done]
    # The body writes its marker before it returns; the outcome is recorded after that.
    [run] = wait_until(
        lambda: [
            row
            for row in ledger(project.env["PGLOCK_DSN"], project.env["TEST_SCHEMA"])
            if row["state"] != "running"
        ],
        timeout=DEADLINE,
        message="the redelivered run's outcome recorded",
    )
    assert (task_id, "succeeded", 2) == (run["slot"], run["state"], run["attempts"])

    project.call(SEND_LONG_AGAIN.format(task_id=task_id))

    skip = wait_until(lambda: skips_of(project, task_id), timeout=DEADLINE, message="the skip")
    assert ["done"] == [row["reason"] for row in skip]
    assert [] == [r for r in project.ran() if r["marker"] == "again"]
    assert worker.alive


def skips_of(project: Project, task_id: str) -> list[dict[str, Any]]:
    query = sql.SQL("SELECT * FROM {} WHERE task_id = %s").format(
        sql.Identifier(project.env["TEST_SCHEMA"], "pglock_skips")
    )
    with (
        psycopg.connect(project.env["PGLOCK_DSN"], autocommit=True) as conn,
        conn.cursor(row_factory=psycopg.rows.dict_row) as cur,
    ):
        return cur.execute(query, (task_id,)).fetchall()


TICK = """
app.conf.beat_schedule = {"tick": {"task": "proj.tasks.record", "schedule": 1.0, "args": ("tick",)}}
"""


def test_operator_sends_of_a_retrofitted_entry_run_under_the_entry_s_lock(
    project: Project,
) -> None:
    """``pglock backfill`` and ``pglock trigger`` of a README-retrofitted entry send its
    slots as the entry's: each missed slot runs once, a slot that ran is not sent again,
    a slot triggered twice runs once, all under the entry's lock name."""
    readme_project(project, TICK)
    project.worker("-P", "prefork", "-c", "2")
    beat = project.beat()
    wait_until(lambda: len(project.ran()) >= 2, timeout=DEADLINE, message="2 slots run")
    beat.stop()
    last = max(row["slot"] for row in project.ran())
    gap_end = wait_until(
        lambda: (moment := utc_seconds(time.time() - 1)) > shifted(last, 2) and moment,
        timeout=DEADLINE,
        message="2 slots missed",
    )

    code, out = project.cli("backfill", "tick", "--from", last, "--to", gap_end, "--json")

    assert 0 == code, out
    plan = json.loads(out)["slots"]
    sent = {p["slot"]: p.get("outcome") for p in plan if p["action"] == "send"}
    assert len(sent) >= 2
    assert set(sent.values()) == {"succeeded"}
    assert last not in sent
    for _ in range(2):
        assert 0 == project.cli("trigger", "tick", "--slot", "manual:once")[0]
    wait_until(
        lambda: "manual:once" in {r["slot"] for r in project.ran()},
        timeout=DEADLINE,
        message="the triggered slot",
    )
    runs = Counter(row["slot"] for row in project.ran())
    assert {1} == set(runs.values())
    assert {*sent, "manual:once"} <= set(runs)
    schema = project.env["TEST_SCHEMA"]
    rows = ledger(project.env["PGLOCK_DSN"], schema)
    assert {f"{schema}:proj.tasks.record@tick"} == {row["lock_name"] for row in rows}
    code, status = project.cli("status")
    assert 0 == code, status
    [record] = [line for line in status.splitlines() if line.startswith("proj.tasks.record ")]
    assert "duplicates only (beat: one at a time per entry)" in record


def utc_seconds(epoch: float) -> str:
    return datetime.fromtimestamp(int(epoch), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def shifted(slot: str, seconds: int) -> str:
    moment = datetime.strptime(slot, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    return utc_seconds(moment.timestamp() + seconds)


def test_a_stock_beat_beside_a_retrofitted_project_is_reported_and_runs_unlocked(
    project: Project,
) -> None:
    """A stock ``celery beat`` left running beside README's scheduler: its slot-less
    messages are distinct work to the retrofit (they run, unlocked), and the worker warns
    once that they are neither locked nor deduplicated."""
    readme_project(project, TICK)
    worker = project.worker("-P", "prefork", "-c", "1")  # one process: one warning
    project.beat()
    wait_until(lambda: len(project.ran()) >= 2, timeout=DEADLINE, message="2 slots run")
    stock = ("--scheduler", "celery.beat:PersistentScheduler")
    project.procs.celery(
        "proj.celery",
        "beat",
        "-l",
        "info",
        *stock,
        f"--schedule={project.root / 'stock'}",
        env=project.env,
        name="beat-stock",
    )

    slotless = wait_until(
        lambda: len(rows := [r for r in project.ran() if r["slot"] is None]) >= 3 and rows,
        timeout=DEADLINE,
        message="3 runs of the stock beat's messages",
    )

    assert len(slotless) >= 3
    worker.wait_for_log("neither locked nor deduplicated", timeout=DEADLINE)
    assert 1 == worker.log_text().count("a message without a slot from")
