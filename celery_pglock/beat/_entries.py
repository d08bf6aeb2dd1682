"""A beat entry as the workers will lock its messages: its lock name.

Beat records each slot it claims under this name, the freshness watch and the operator
commands look slots up by it, and the worker derives the same name from the message
(``names.lock_name``, with the entry's name from the ``pglock_entry`` header).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from celery_pglock._config import TaskOptions, enabled_setting, namespace_of
from celery_pglock._keys import default_lock_name
from celery_pglock._names import lock_name
from celery_pglock._retrofit import SETTING as ALL_TASKS
from celery_pglock._task import PgLockMixin
from celery_pglock.errors import ConfigurationError

logger = logging.getLogger("celery_pglock.beat")


class _Unregistered:
    """A task beat cannot import (it sends it by name): only the app's settings apply."""

    def __init__(self, name: str) -> None:
        self.name = name


def entry_lock_name(app: Celery, entry: Any, resolved: dict[str, TaskOptions] | None = None) -> str:
    """The lock name a worker uses for ``entry``'s messages, as far as beat can tell (a
    task beat cannot import is judged by the app's settings alone; ``resolved`` keeps
    those options per task name, as a registered task keeps its own: resolving them is
    most of a tick's own work at 10,000 entries)."""
    task = app.tasks.get(entry.task)
    try:
        if isinstance(task, PgLockMixin):
            options = task.pglock_options()
        elif resolved is not None and entry.task in resolved:
            options = resolved[entry.task]
        else:
            app_wide = enabled_setting(app.conf, ALL_TASKS) or issubclass(app.Task, PgLockMixin)
            stand_in = _Unregistered(entry.task)
            options = TaskOptions.resolve(stand_in, app.conf, app.main, app_wide=app_wide)
            if resolved is not None:
                resolved[entry.task] = options
        call = (entry.args or (), entry.kwargs or {})
        return lock_name(entry.task, options, *call, entry=entry.name)
    except ConfigurationError:  # the worker reports it, with the message's arguments
        logger.debug("the lock name of entry %s failed in beat", entry.name, exc_info=True)
        return default_lock_name(namespace_of(app.conf, app.main), entry.task)


__all__ = ["entry_lock_name"]
