"""``pglock_all_tasks = True``: lock every task of an app from configuration alone.

Celery reads ``task_cls`` only from the ``Celery(...)`` constructor: set in ``app.conf``,
``config_from_object`` or Django's ``CELERY_TASK_CLS`` it is silently ignored. So the
setting acts itself, when the app finalizes: every registered task's class gets
``PgLockMixin`` in front of the class it already has (``DjangoTask``, a project's own base
class, whatever a framework installed), and so does every task registered afterwards
(Django's autodiscovery imports task modules after the worker finalized the app).

This module is imported with the package, which the ``celery`` command imports through
our ``celery.commands`` entry point before it loads ``-A proj``: workers, beat and the
``pglock`` commands started by ``celery`` need no import in the project's code.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from celery import Celery
from celery import _state as celery_state
from celery import signals as celery_signals
from celery.app.registry import TaskRegistry

from celery_pglock._config import APP_WIDE_MARK, TASK_OPTIONS, enabled_setting
from celery_pglock._messages import BUILTIN_PREFIX, SLOT_HEADER, checked_slot, headers_of
from celery_pglock._task import STARTUP_STEP, PgLockMixin

logger = logging.getLogger("celery_pglock")

SETTING = "pglock_all_tasks"

# Task.bind warns about these deprecated routing attributes when a class defines them
# itself: the locked class carries them too, so that the warning is kept.
ROUTING_ATTRIBUTES = (
    "queue",
    "exchange",
    "exchange_type",
    "routing_key",
    "delivery_mode",
    "priority",
)
LOCKED_CLASS = "_pglock_locked_class"

_classes_lock = threading.Lock()
_warned: set[str] = set()  # task names already warned about, in this process


def locked_class(cls: type) -> type:
    """``cls`` with ``PgLockMixin`` in front; one class per original, so tasks of one
    class stay of one class."""
    # Kept on the original class, not in a module-level dict: such a dict would keep every
    # task class, and so every app (a test suite builds hundreds), alive for good.
    with _classes_lock:
        found: type | None = cls.__dict__.get(LOCKED_CLASS)
        if found is None:
            namespace: dict[str, Any] = {
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                APP_WIDE_MARK: True,  # only duplicates are skipped (``policy``)
            }
            namespace.update({a: cls.__dict__[a] for a in ROUTING_ATTRIBUTES if a in cls.__dict__})
            # The options the task was declared with (@app.task(pglock_scope=...) sets them
            # on its class): PgLockMixin, first in the bases, would hide them behind its own
            # unset ones.
            namespace.update(
                {a: getattr(cls, a) for a in TASK_OPTIONS if getattr(cls, a, None) is not None}
            )
            found = type(cls.__name__, (PgLockMixin, cls), namespace)
            type.__setattr__(cls, LOCKED_CLASS, found)
        return found


def lock_task(task: Any) -> None:
    """Make ``task`` a locked task in place (Celery's own ``celery.*`` tasks stay as they
    are: locking ``chord_unlock`` would stall chords)."""
    if isinstance(task, PgLockMixin) or str(task.name).startswith(BUILTIN_PREFIX):
        return
    task.__class__ = locked_class(type(task))


def _app_of(task: Any) -> Celery | None:
    """The app ``task`` was created for, if it says (``task.app`` would bind it to the
    current app as a side effect)."""
    for klass in type(task).__mro__:
        found = vars(klass).get("app", vars(klass).get("_app"))
        if isinstance(found, Celery):
            return found
    return None


class LockingRegistry(TaskRegistry):
    """Celery's task registry; makes each task it is given a locked task when the task's
    app sets ``pglock_all_tasks``.

    The default registry of every app created once this module is imported: a task is
    then locked as it is created, also in a process that never finalizes its app (one
    that only sends tasks, or calls them eagerly in a test suite), where the finalize
    hook below would never run.
    """

    def __setitem__(self, name: str, task: Any) -> None:
        app = _app_of(task)
        if app is not None and enabled_setting(app.conf, SETTING):
            lock_task(task)
        super().__setitem__(name, task)


def retrofit(app: Celery) -> bool:
    """Apply ``pglock_all_tasks`` to ``app`` if it is set; True if it was."""
    if not enabled_setting(app.conf, SETTING):
        return False
    registry = app.tasks  # the app is finalized (or finalizing): no side effect
    for task in list(registry.values()):  # registered before the setting was read
        lock_task(task)
    if not isinstance(registry, LockingRegistry):
        registry.__class__ = LockingRegistry
    # What PgLockMixin.on_bound does, for tasks that were bound before (a set: idempotent).
    app.steps["worker"].add(STARTUP_STEP)
    return True


@celery_state.connect_on_app_finalize
def _retrofit_on_finalize(app: Celery) -> None:
    # Runs before the app evaluates its pending @app.task decorators and binds its tasks,
    # so each task is bound (PgLockMixin.on_bound adds the worker's start-up check) as a
    # locked task.
    retrofit(app)


def _retrofit_finalized_apps() -> None:
    # Imported after an app finalized (an in-process test worker, a script): apply now.
    for app in list(celery_state._get_active_apps()):  # type: ignore[attr-defined]
        if app.finalized:
            retrofit(app)


@celery_signals.before_task_publish.connect
def _slot_option_to_header(
    headers: Any = None, properties: Any = None, sender: Any = None, **_: Any
) -> None:
    # `apply_async(pglock_slot=...)`, `send_task(..., pglock_slot=...)` and
    # `.set(pglock_slot=...)`: Celery puts options it does not know into the message's
    # properties, which RabbitMQ drops; the worker reads the slot from the headers.
    if not isinstance(properties, dict) or SLOT_HEADER not in properties:
        return
    slot = properties.pop(SLOT_HEADER)
    if slot is not None and isinstance(headers, dict):
        headers[SLOT_HEADER] = checked_slot(str(sender), slot)


@celery_signals.task_prerun.connect
def _warn_unlocked(task: Any = None, **_: Any) -> None:
    # A slot header on a task that is not locked means the retrofit did not take: the
    # task runs, unlocked, and would run twice. Say so once per task and process.
    if task is None or isinstance(task, PgLockMixin) or task.name in _warned:
        return
    request = task.request
    if headers_of(request).get(SLOT_HEADER) is None and not getattr(request, SLOT_HEADER, None):
        return
    _warned.add(task.name)
    logger.warning(
        "%s received a message with a %s header but is not a locked task: it runs "
        "UNLOCKED, and duplicates of its slots run again. To lock it: set "
        "app.conf.pglock_all_tasks = True (Django: CELERY_PGLOCK_ALL_TASKS = True), or "
        "@app.task(base=PgLockTask)",
        task.name,
        SLOT_HEADER,
        extra={"action": "pglock_task_not_locked", "task": task.name},
    )


_retrofit_finalized_apps()
if Celery.registry_cls in (TaskRegistry, "celery.app.registry:TaskRegistry"):
    # Read by Celery(...) when it builds an app's registry; an app class with a registry
    # of its own is left alone (its tasks are locked when it finalizes).
    Celery.registry_cls = LockingRegistry  # type: ignore[assignment]

__all__ = ["LockingRegistry", "lock_task", "locked_class", "retrofit"]
