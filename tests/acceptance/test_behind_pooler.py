"""README's retrofit lines, as written, with the DSN pointed at PgBouncer in transaction
pooling (the Debian package, started by the test): every guarantee holds on rows.

The project is the stock one of the retrofit tests (``retrofit_support``); only
``PGLOCK_DSN`` differs, as for a team whose only endpoint is pooled. Beat replicas behind
the pooler: tests/acceptance/test_beat_failover.py (``kill-pooled``, ``freeze-pooled``).
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.acceptance.retrofit_support import (
    DEADLINE,
    Project,
    one_slot_runs_once,
    project,
    readme_project,
    users,
)
from tests.faults.pgbouncer import started
from tests.fixtures.procs import Procs, wait_until

__all__ = ["project"]  # the fixture

pytestmark = pytest.mark.acceptance

LEASE = 2.0  # seconds: pglock_lease of the project, short so that a freeze ends it soon
# Room on top of the lease for a loaded machine: the heartbeat's third, a poll, a start-up.
TAKEOVER_MARGIN = 3.0

EIGHT_EMAILS = """
results = [tasks.send_welcome_email.delay(user) for user in range(8)]
print(json.dumps([[r.get(timeout=60), r.state] for r in results]))
"""
# Tasks of the project locked one at a time (README's "Or lock chosen tasks"), longer
# than their lease, so that only renewals keep the lock; and one that writes through a
# fence once a file (its gate) exists.
LOCKED_TASKS = f"""
import os
import itertools
import time

from celery_pglock import PgLockTask, fence
from proj.tasks import note

app.conf.pglock_lease = {LEASE}


@app.task(bind=True, base=PgLockTask)
def long_cleanup(self, marker):
    note(self, f"start {{marker}}")
    time.sleep({3 * LEASE})
    note(self, f"end {{marker}}")
    return marker


@app.task(bind=True, base=PgLockTask, pglock_key=lambda *_, **__: "fenced")
def fenced_write(self, marker, gate):
    note(self, f"start {{marker}} {{os.getpid()}}")
    while not os.path.exists(gate):
        time.sleep(0.05)
    conn = self.pglock.connection
    with conn.transaction():
        fence(conn, "report.csv", self.pglock.token)   # raises StaleToken if superseded
    note(self, f"wrote {{marker}}")
    return marker
"""
# Sent while the first runs: one message a second for three leases; each is skipped
# (locked) or, once the first ended, runs.
OVERLAPPING = f"""
import itertools
import time
from proj.celery import long_cleanup
results = [long_cleanup.delay("first")]
for n in range({int(3 * LEASE) + 2}):
    time.sleep(1)
    results.append(long_cleanup.delay(f"later-{{n}}"))
print(json.dumps([[r.get(timeout=60), r.state] for r in results]))
"""
# Sends until one message runs: each is skipped while the frozen holder's row lives.
UNTIL_GRANTED = """
import itertools
import time
from proj.celery import fenced_write
while True:
    result = fenced_write.delay("second", "{gate}")
    result.get(timeout=60, propagate=False)
    if result.state != "SKIPPED":
        break
    time.sleep(0.2)
print(json.dumps([result.result, result.state]))
"""


@pytest.fixture
def pooled(project: Project, procs: Procs, pg_dsn: str) -> Iterator[Project]:
    """The project with ``PGLOCK_DSN`` through PgBouncer in transaction pooling."""
    with started(pg_dsn, procs.log_dir / "pgbouncer.log") as bouncer:
        project.env["PGLOCK_DSN"] = bouncer.dsn_for("tx")
        yield project


def test_behind_a_pooler_eight_welcome_emails_all_go_out_once_each(pooled: Project) -> None:
    """README's lines, eight ``.delay(user)`` on ``-c 4``: eight SUCCESS, each user once;
    the worker says at start-up that it holds its locks on rows, and why."""
    readme_project(pooled)
    worker = pooled.worker("-P", "prefork", "-c", "4")

    results = pooled.call(EIGHT_EMAILS)

    assert [[user, "SUCCESS"] for user in range(8)] == results
    assert Counter({f"user-{user}": 1 for user in range(8)}) == users(pooled)
    said = "holds session-scope locks on rows (a row with a lease, renewed by the heartbeat): "
    assert said + "a transaction pooler stands between" in worker.log_text()


def test_behind_a_pooler_one_slot_sent_eight_times_runs_once(pooled: Project) -> None:
    """The same slot eight times at once: one run, seven SKIPPED (done or locked)."""
    readme_project(pooled)
    pooled.worker("-P", "prefork", "-c", "4")

    one_slot_runs_once(pooled, 8)


def intervals(project: Project) -> list[tuple[float, float]]:
    """(start, end) of each finished run of ``long_cleanup``, from its notes."""
    by_task: dict[str, dict[str, float]] = {}
    for row in project.ran():
        kind = row["marker"].split(" ", 1)[0]
        if kind in ("start", "end"):
            by_task.setdefault(row["task_id"], {})[kind] = row["at"].timestamp()
    return sorted((t["start"], t["end"]) for t in by_task.values() if "end" in t)


def test_behind_a_pooler_a_long_locked_job_is_never_overlapped(pooled: Project) -> None:
    """A one-at-a-time job three leases long, a new message every second: its lock is kept
    by renewals alone, each message meanwhile is SKIPPED (locked), and no two runs of it
    overlap; ``celery pglock status`` through the pooler shows its holder, on rows."""
    readme_project(pooled, LOCKED_TASKS)
    pooled.worker("-P", "prefork", "-c", "4")

    sending = pooled.call_async(OVERLAPPING)
    wait_until(lambda: started_note(pooled, "first"), timeout=DEADLINE, message="first runs")
    code, shown = pooled.cli("status")
    results = sending.result(DEADLINE * 2)

    assert 0 == code, shown
    assert "session-scope locks and beat's leader on rows (a transaction pooler" in shown
    held = [line for line in shown.splitlines() if "long_cleanup" in line and "(rows)" in line]
    assert 1 == len(held), shown  # its holder: SCOPE "session (rows)"

    runs = intervals(pooled)
    assert [] == [(a, b) for a, b in itertools.pairwise(runs) if b[0] < a[1]]
    first_start, first_end = runs[0]
    assert first_end - first_start >= 3 * LEASE  # it outlived its lease thrice, renewed
    # Messages sent while it ran were skipped (how many depends on the machine's load:
    # that none overlapped it past its lease is the promise, checked above).
    skipped = [meta["reason"] for meta, state in results if state == "SKIPPED"]
    assert {"locked"} == set(skipped)
    assert "SUCCESS" == results[0][1]


@pytest.mark.serial  # it times a freeze against the lease (a guarantee, its margin)
def test_behind_a_pooler_a_frozen_holder_loses_its_lock_and_its_write(
    pooled: Project, tmp_path: Path
) -> None:
    """A holder SIGSTOPped mid-run: within its lease another worker gets the lock (a new
    message runs), writes through the fence; woken, the old holder's fenced write is
    refused (``StaleToken``) and its run fails."""
    readme_project(pooled, LOCKED_TASKS)
    first_worker = pooled.worker("-P", "solo")
    first_gate, second_gate = tmp_path / "first", tmp_path / "second"
    second_gate.touch()  # the second run writes at once
    first = pooled.call_async(
        "from proj.celery import fenced_write\n"
        f'r = fenced_write.delay("first", "{first_gate}")\n'
        "print(json.dumps([r.get(timeout=120, propagate=False).__class__.__name__, r.state]))"
    )
    wait_until(lambda: started_note(pooled, "first"), timeout=DEADLINE, message="first runs")
    first_worker.freeze()
    frozen_at = time.time()
    pooled.worker("-P", "solo")

    second = pooled.call(UNTIL_GRANTED.replace("{gate}", str(second_gate)))

    assert ["second", "SUCCESS"] == second
    second_start = started_note(pooled, "second")
    assert second_start is not None
    assert second_start - frozen_at < LEASE + TAKEOVER_MARGIN
    first_worker.thaw()
    first_gate.touch()
    assert ["StaleToken", "FAILURE"] == first.result(timeout=DEADLINE * 2)
    assert "wrote first" not in {row["marker"] for row in pooled.ran()}


def started_note(project: Project, marker: str) -> float | None:
    """When the run of ``marker`` started (its ``start`` note), if it did."""
    for row in project.ran():
        if row["marker"].startswith(f"start {marker}"):
            return float(row["at"].timestamp())
    return None
