"""The retrofit as a user applies it: a stock Celery project, changed only as documented.

Each test writes a small project into its own folder (an app module that knows nothing of
celery-pglock, plus one documented retrofit form), runs it in real ``celery worker`` and
``celery beat`` processes, and sends from a separate process that plays the web server.
The README's lines are read out of README.md and executed as they stand.
"""

from __future__ import annotations

import pytest

from tests.acceptance.retrofit_support import (
    APP_MODULE,
    DEADLINE,
    DJANGO_CELERY,
    DJANGO_SETTINGS,
    SLOT,
    Project,
    has_django_task,
    project,
    readme_retrofit,
    skipped,
)
from tests.apps.harness import ledger
from tests.fixtures.procs import wait_until

__all__ = ["project"]  # the fixture

pytestmark = pytest.mark.acceptance


def test_readme_retrofit_lines_run_each_beat_slot_once_across_two_beats(project: Project) -> None:
    """README's retrofit block, verbatim: 2 beats + 1 worker run every 1-s slot once."""
    schedule = '\napp.conf.beat_schedule = {"tick": {"task": "proj.tasks.record", "schedule": 1.0}}'
    project.write("celery", APP_MODULE.format(name="proj") + readme_retrofit() + schedule)
    project.worker("-P", "prefork", "-c", "2")
    project.beat()
    project.beat()

    rows = wait_until(
        lambda: (found := project.ran()) and len({r["slot"] for r in found}) >= 5 and found,
        timeout=DEADLINE,
        message="5 beat slots run",
    )

    slots = [row["slot"] for row in rows]
    assert all(slots)  # every beat message was locked under its slot
    assert len(slots) == len(set(slots))


def test_readme_retrofit_lines_dedupe_a_slot_sent_four_times(project: Project) -> None:
    """README's block, verbatim: one slot sent 4 times with pglock_slot= runs once."""
    project.write("celery", APP_MODULE.format(name="proj") + readme_retrofit())
    project.worker("-P", "prefork", "-c", "2")

    results = project.send(SLOT, 4)

    assert 1 == len(project.ran())
    assert 3 == len(skipped(results))
    assert set(skipped(results)) <= {"done", "locked"}


def test_retry_from_a_locked_task_is_published_and_runs(project: Project) -> None:
    """``self.retry()`` inside a locked task: the retry runs (the lease never rides in the
    retry's message) and the slot succeeds on the second attempt."""
    project.write("celery", APP_MODULE.format(name="proj") + readme_retrofit())
    project.worker("-P", "prefork", "-c", "2")

    [(result, state)] = project.send(SLOT, 1, task="retry_once")

    assert ("SUCCESS", "m0") == (state, result)
    markers = [row["marker"] for row in project.ran()]
    assert ["try0", "try1"] == [marker for marker in markers if marker.startswith("try")]
    assert "retry published, lock held: False" in markers
    [run] = ledger(project.env["PGLOCK_DSN"], project.env["TEST_SCHEMA"])
    assert (SLOT, "succeeded", 2) == (run["slot"], run["state"], run["attempts"])


def test_config_from_object_module_retrofits_every_task(project: Project) -> None:
    """``pglock_all_tasks = True`` in a config module (config_from_object): locked, once."""
    project.write("celeryconfig", "pglock_all_tasks = True\n")
    module = APP_MODULE.format(name="proj") + 'app.config_from_object("proj.celeryconfig")\n'
    project.write("celery", module)
    project.worker("-P", "solo")

    results = project.send(SLOT, 3, imports="import celery_pglock")

    assert 1 == len(project.ran())
    assert 2 == len(skipped(results))


def test_task_cls_constructor_argument_retrofits_every_task(project: Project) -> None:
    """``Celery(..., task_cls="celery_pglock:PgLockTask")``, the constructor form: once."""
    module = APP_MODULE.format(name="proj").replace(
        'Celery("proj")', 'Celery("proj", task_cls="celery_pglock:PgLockTask")'
    )
    project.write("celery", module)
    project.worker("-P", "solo")

    results = project.send(SLOT, 3, imports="import celery_pglock")

    assert 1 == len(project.ran())
    assert 2 == len(skipped(results))


def test_django_setting_retrofits_and_keeps_django_task(project: Project) -> None:
    """``CELERY_PGLOCK_ALL_TASKS = True`` in Django settings: locked, and still a DjangoTask
    (``delay_on_commit``) where Celery's Django fixup installs one (Celery >= 5.4)."""
    project.write("settings", DJANGO_SETTINGS)
    project.write("celery", DJANGO_CELERY)
    project.worker("-P", "solo")

    results = project.send(SLOT, 3, imports="import celery_pglock")

    [row] = project.ran()
    assert 2 == len(skipped(results))
    assert "PgLockMixin" in row["classes"]
    assert has_django_task() == ("DjangoTask" in row["classes"])


def test_worker_warns_once_when_a_slotted_message_reaches_an_unlocked_task(
    project: Project,
) -> None:
    """No retrofit: a message with a pglock_slot header runs unlocked, with one WARNING
    per task that names the fix."""
    project.write("celery", APP_MODULE.format(name="proj") + "import celery_pglock\n")
    worker = project.worker("-P", "solo")

    results = project.send(SLOT, 3)

    assert 3 == len(project.ran())  # unlocked: every duplicate ran
    assert ["SUCCESS"] * 3 == [state for _, state in results]
    worker.wait_for_log("pglock_all_tasks = True", timeout=DEADLINE)
    assert 1 == worker.log_text().count("is not a locked task")
