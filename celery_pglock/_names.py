"""A task's lock name, defined once (the pure parts, namespace and leader's lock name
included, are in ``keys``).

A locked task's lock name is its ``pglock_key`` (a string, or a function of the task's
arguments), else ``<namespace>:<task name>``; a beat entry's message of a task locked
app-wide (``TaskOptions.retrofit``) has its entry's, ``<namespace>:<task name>@<entry>``,
so that two entries of one task never take each other's slots. The worker derives it for
each message; the enqueue check, beat and the operator commands derive the same name
before any message.
"""

from __future__ import annotations

from typing import Any

from celery_pglock._config import TaskOptions
from celery_pglock._keys import check_lock_name, default_lock_name, entry_lock_name
from celery_pglock._messages import call_option
from celery_pglock.errors import ConfigurationError


def lock_name(
    task_name: str, options: TaskOptions, args: Any, kwargs: Any, *, entry: str | None = None
) -> str:
    """The lock name of one call of a task (``entry``: the beat entry that sent it);
    ``ConfigurationError`` if ``pglock_key`` fails."""
    key = options.key
    if key is None and options.retrofit and entry is not None:
        name, source = entry_lock_name(options.namespace, task_name, entry), "its beat entry"
    elif key is None:
        return default_lock_name(options.namespace, task_name)
    else:
        name = call_option(task_name, "pglock_key", key, args, kwargs) if callable(key) else key
        source = "pglock_key"
    try:
        return check_lock_name(name)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{task_name}: {source} gave an invalid name: {exc}") from None


def fixed_lock_name(task_name: str, options: TaskOptions) -> str | None:
    """The task's lock name when its arguments do not choose it, else None."""
    return None if callable(options.key) else lock_name(task_name, options, (), {})
