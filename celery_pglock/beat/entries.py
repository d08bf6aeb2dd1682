"""A beat entry as the workers will lock its messages: its lock name.

Beat records each slot it claims under this name, the freshness watch and the operator
commands look slots up by it, and the worker derives the same name from the message
(``names.lock_name``).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery

from celery_pglock.errors import ConfigurationError
from celery_pglock.keys import default_lock_name, namespace
from celery_pglock.names import lock_name
from celery_pglock.task import PgLockMixin

logger = logging.getLogger("celery_pglock.beat")


def entry_lock_name(app: Celery, entry: Any) -> str:
    """The lock name a worker uses for ``entry``'s messages, as far as beat can tell."""
    task = app.tasks.get(entry.task)
    if not isinstance(task, PgLockMixin):
        return default_lock_name(namespace(app.conf.get("pglock_namespace"), app.main), entry.task)
    options = task.pglock_options()
    try:
        return lock_name(entry.task, options, entry.args or (), entry.kwargs or {})
    except ConfigurationError:  # the worker reports it, with the message's arguments
        logger.debug("pglock_key of %s failed in beat", entry.task, exc_info=True)
        return default_lock_name(options.namespace, entry.task)


__all__ = ["entry_lock_name"]
