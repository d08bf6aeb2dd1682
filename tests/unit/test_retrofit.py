"""``pglock_all_tasks``: which tasks become locked tasks, and what they keep (no database)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from celery import Celery, Task

from celery_pglock import ConfigurationError, PgLockMixin
from celery_pglock._retrofit import locked_class, retrofit


def make_app(**conf: Any) -> Celery:
    app = Celery("retro", set_as_current=False)
    app.conf.update(broker_url="memory://", **conf)
    return app


class FrameworkTask(Task):
    """Stands for a base class a framework installs (Django's DjangoTask)."""

    def framework_feature(self) -> str:
        return "kept"


def test_every_task_of_the_app_becomes_locked_when_it_finalizes() -> None:
    """Tasks declared before finalize, plain or with their own base, are locked after it."""
    app = make_app(pglock_all_tasks=True)

    @app.task(name="retro.plain", shared=False)
    def plain() -> None: ...

    @app.task(name="retro.based", base=FrameworkTask, shared=False)
    def based() -> None: ...

    app.finalize()

    assert isinstance(app.tasks["retro.plain"], PgLockMixin)
    assert isinstance(app.tasks["retro.based"], PgLockMixin)
    assert "kept" == app.tasks["retro.based"].framework_feature()


def test_a_task_registered_after_finalize_is_locked() -> None:
    """Django's autodiscovery imports task modules after the worker finalized the app."""
    app = make_app(pglock_all_tasks=True)
    app.finalize()

    @app.task(name="retro.late", shared=False)
    def late() -> None: ...

    assert isinstance(app.tasks["retro.late"], PgLockMixin)


def test_a_task_is_locked_when_it_is_created_in_an_app_that_never_finalizes() -> None:
    """A process that only sends tasks or calls them eagerly (a web process, a test suite)
    may never finalize its app: its tasks are locked all the same, so that enqueue checks
    and eager calls behave as in the worker."""
    app = make_app(pglock_all_tasks=True)

    @app.task(name="retro.sent", shared=False)
    def sent() -> None: ...

    assert "retro.sent" == sent.name  # evaluates the task, as delay() or apply() does
    assert isinstance(sent._get_current_object(), PgLockMixin)  # type: ignore[attr-defined]
    assert not app.finalized


def test_celerys_own_tasks_are_left_unlocked() -> None:
    """``celery.*`` tasks (chord_unlock, backend_cleanup) are never locked."""
    app = make_app(pglock_all_tasks=True)
    app.finalize()

    builtins = [task for name, task in app.tasks.items() if name.startswith("celery.")]

    assert builtins
    assert not any(isinstance(task, PgLockMixin) for task in builtins)


def test_without_the_setting_nothing_changes() -> None:
    """No ``pglock_all_tasks``: tasks stay Celery's plain tasks."""
    app = make_app()

    @app.task(name="retro.plain", shared=False)
    def plain() -> None: ...

    app.finalize()

    assert not isinstance(app.tasks["retro.plain"], PgLockMixin)


def test_a_setting_that_is_not_a_bool_fails_at_finalize() -> None:
    """``pglock_all_tasks = "yes"`` is refused with the setting named."""
    app = make_app(pglock_all_tasks="yes")

    with pytest.raises(ConfigurationError, match="pglock_all_tasks must be True or False"):
        app.finalize()


def test_an_app_finalized_before_the_setting_is_retrofitted_on_request() -> None:
    """``retrofit(app)`` applies the setting to an app that finalized earlier."""
    app = make_app()

    @app.task(name="retro.plain", shared=False)
    def plain() -> None: ...

    app.finalize()
    app.conf.pglock_all_tasks = True

    assert retrofit(app)
    assert isinstance(app.tasks["retro.plain"], PgLockMixin)


def test_one_locked_class_per_original_class() -> None:
    """Tasks of one class stay of one class: the locked class is made once."""
    assert locked_class(FrameworkTask) is locked_class(FrameworkTask)
    assert FrameworkTask in locked_class(FrameworkTask).__mro__


def test_retrofitted_apps_are_not_kept_alive() -> None:
    """A retrofitted app closed and dropped is garbage (test suites build hundreds)."""
    refs = []
    for number in range(5):
        app = make_app(pglock_all_tasks=True)

        @app.task(name=f"retro.gone{number}", shared=False)
        def gone() -> None: ...

        app.finalize()
        refs.append(weakref.ref(app))
        app.close()
        del app, gone
    gc.collect()

    assert [] == [ref for ref in refs if ref() is not None]


def test_a_locked_task_keeps_the_options_it_was_declared_with() -> None:
    """@app.task(pglock_...=...) under pglock_all_tasks: the task's own options count
    (found running the README's retrofit lines: they were hidden behind PgLockMixin's)."""
    app = make_app(pglock_all_tasks=True)

    @app.task(
        name="retro.policies",
        shared=False,
        pglock_concurrency=3,
        pglock_overlap="buffer_one",
        pglock_scope="transaction",
    )
    def policies() -> None: ...

    app.finalize()
    options = app.tasks["retro.policies"].pglock_options()

    assert (3, "buffer_one", "transaction") == (
        options.concurrency,
        options.overlap,
        options.scope,
    )
