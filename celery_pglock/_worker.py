"""The worker's side of celery-pglock: a start-up step and Celery's process signals.

``StartupCheck`` waits for PostgreSQL when it is away as the worker starts (``startup``),
stops the worker with one line when the DSN, the server or the schema is wrong, and
sizes each process's lock connections to the worker's pool. It blocks in ``start``: the
Consumer, the worker's last step, starts only after it, so no message is consumed (and
the worker is not ``ready``) before the check passed. The signal hooks open a prefork
child's own pool after fork, record the attempt of a pool child that died mid-task, and
close the pools when a process shuts down.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, ClassVar

from celery import Celery, bootsteps
from celery import signals as celery_signals
from celery.exceptions import WorkerLostError
from celery.worker import state as worker_state

from celery_pglock import _policy as policy
from celery_pglock._config import Settings, app_settings
from celery_pglock._ledger import record_worker_lost
from celery_pglock._messages import BUILTIN_PREFIX
from celery_pglock._startup import refuse_to_start, wait_for_postgres
from celery_pglock._task import PgLockMixin, locking
from celery_pglock.errors import ConfigurationError, PgLockError
from celery_pglock.store._connections import FIX_BACKEND, pooler_message
from celery_pglock.store._database import (
    check_server,
    chosen_backend,
    close_all,
    database,
    serve_tasks,
    size_for_worker,
    waits_block_greenlets,
)

logger = logging.getLogger("celery_pglock")

# Whether this worker's start-up check passed. Prefork children forked before it (the
# Pool step starts first) connect at their first task, which comes after it.
_checked = False


class StartupCheck(bootsteps.StartStopStep):
    """Wait for PostgreSQL at start-up; stop the worker with one line naming the fix when
    the DSN, the server or the schema is wrong; size the lock connections to the worker's
    pool and say how many a process may open."""

    label = "celery-pglock"

    # Celery's pools by module: threads, gevent and eventlet run the worker's tasks at
    # once inside its main process; prefork runs each in a child, one at a time.
    POOL_NAMES: ClassVar[dict[str, str]] = {
        "celery.concurrency.prefork": "prefork",
        "celery.concurrency.solo": "solo",
        "celery.concurrency.thread": "threads",
        "celery.concurrency.gevent": "gevent",
        "celery.concurrency.eventlet": "eventlet",
    }
    IN_PROCESS: ClassVar[frozenset[str]] = frozenset({"threads", "gevent", "eventlet"})

    def start(self, worker: Any) -> None:
        if not locking(worker.app):  # the test mode: no database, said once
            return
        try:
            self._check(worker)
        except PgLockError as exc:  # a misconfiguration, or the wait given up
            refuse_to_start("worker", logger, exc)

    def _check(self, worker: Any) -> None:
        global _checked  # noqa: PLW0603 - one process-wide fact, inherited by forked children
        check_task_options(worker.app)
        log_locking(worker.app)
        serve_tasks()
        settings = app_settings(worker.app)
        pooled = wait_for_postgres(
            settings,
            lambda: check_server(settings),
            who="worker",
            logger=logger,
            interrupt=worker_state.maybe_shutdown,  # SIGTERM while waiting: stop waiting
        )
        backend, why = chosen_backend(settings, pooled)
        session_scoped = _session_scope_tasks(worker.app) if pooled else []
        if backend == "advisory" and session_scoped:
            logger.error(
                "%s; these tasks will fail: %s",
                pooler_message(settings, "session-scope advisory locks", FIX_BACKEND),
                ", ".join(session_scoped),
                extra={"action": "pglock_transaction_pooler"},
            )
        logger.info(
            "celery-pglock holds session-scope locks on %s: %s",
            "rows (a row with a lease, renewed by the heartbeat)"
            if backend == "rows"
            else "advisory locks (freed the moment their session ends)",
            why,
            extra={"action": "pglock_lock_backend", "backend": backend},
        )
        self._size_connections(worker, settings)
        _checked = True
        logger.info("celery-pglock ready: %r", settings, extra={"action": "pglock_ready"})

    @classmethod
    def _size_connections(cls, worker: Any, settings: Settings) -> None:
        # This step runs in the worker's main process before it consumes: where threads,
        # gevent and eventlet run the tasks. Prefork's children, forked by the Pool step
        # before this one, keep the default size.
        pool = cls._pool_name(worker.pool_cls)
        concurrency = max(worker.concurrency or 1, getattr(worker, "max_concurrency", 0) or 0)
        in_process = pool in cls.IN_PROCESS or bool(getattr(worker.pool_cls, "is_green", False))
        size = size_for_worker(settings, concurrency if in_process else None)
        who, how = "each worker process", ""
        if pool == "prefork":
            how = f"{concurrency} processes, {concurrency * size} connections in all"
        elif in_process:
            who, how = "this worker process", "its tasks run in this process"
            if settings.shared_sessions:
                how += ", their session-scope locks on one shared session"
        elif pool == "solo":
            who = "this worker process"
        idle = settings.idle_timeout
        logger.info(
            "celery-pglock: %s opens at most %d PostgreSQL connections for locks "
            "(pool %s, concurrency %d%s; pglock_pool_size %s), closes each after %s idle "
            "(pglock_idle_timeout) and leaves the server's last %d free slots to other "
            "clients when connected to it directly (pglock_spare_connections; through a "
            "pooler, the pooler's limits count)",
            who,
            size,
            pool,
            concurrency,
            f": {how}" if how else "",
            "auto" if settings.pool_size is None else settings.pool_size,
            "never" if idle is None else f"{idle:g} s",
            settings.spare_connections,
            extra={
                "action": "pglock_connections",
                "pool": pool,
                "concurrency": concurrency,
                "connections_per_process": size,
                "idle_timeout": idle,
                "spare_connections": settings.spare_connections,
            },
        )
        if in_process and settings.pool_size is not None and settings.pool_size < concurrency:
            # With a shared session, session-scope runs need none of their own.
            which = "runs needing a connection of their own (transaction scope, waits)"
            logger.warning(
                "pglock_pool_size = %d is below this worker's concurrency (%d, pool %s): "
                "%s beyond %d at once queue for a PostgreSQL connection, handed "
                "over in order as runs end; one that sees none come back for "
                "pglock_connect_timeout (%.1f s) is retried. To fix: "
                "remove pglock_pool_size (auto: concurrency + 1) or set it to at least %d",
                settings.pool_size,
                concurrency,
                pool,
                which if settings.shared_sessions else "locked tasks",
                settings.pool_size,
                settings.connect_timeout,
                concurrency + 1,
                extra={"action": "pglock_pool_size_too_small", "pool": pool},
            )
        if getattr(worker.pool_cls, "is_green", False) and waits_block_greenlets():
            logger.warning(
                "pool %s: psycopg waits for PostgreSQL without yielding to other greenlets "
                "(it detects gevent, not eventlet): each statement pauses every task of this "
                "worker, and one longer than pglock_lease makes other tasks lose their locks. "
                "To fix: start the worker with PSYCOPG_WAIT_FUNC=wait_select in its environment",
                pool,
                extra={"action": "pglock_greenlets_blocked", "pool": pool},
            )

    @classmethod
    def _pool_name(cls, pool_cls: Any) -> str:
        for klass in getattr(pool_cls, "__mro__", ()):
            if klass.__module__ in cls.POOL_NAMES:
                return cls.POOL_NAMES[klass.__module__]
        return f"{pool_cls.__module__}.{pool_cls.__qualname__}"


def check_task_options(app: Celery) -> None:
    """Refuse to start with a locked task whose options are invalid (an unknown
    ``pglock_overlap``, a ``pglock_concurrency`` of 0, ...): each error names the task and
    the valid choices, all at once, before the first message runs into one."""
    errors: list[str] = []
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, PgLockMixin) and not name.startswith(BUILTIN_PREFIX):
            try:
                task.pglock_options()
            except ConfigurationError as exc:
                errors.append(str(exc))
    if errors:
        raise ConfigurationError("invalid celery-pglock task options: " + "; ".join(errors))


def log_locking(app: Celery) -> None:
    """Say what each locked task's messages lock, one line per kind (``policy.describe``):
    duplicates only, one at a time, N at a time."""
    kinds: dict[str, list[str]] = {}
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, PgLockMixin) and not name.startswith(BUILTIN_PREFIX):
            kinds.setdefault(policy.describe(task.pglock_options()), []).append(name)
    for kind, names in kinds.items():
        logger.info(
            "celery-pglock locks %s: %s",
            kind,
            ", ".join(names),
            extra={"action": "pglock_task_locking", "locking": kind, "tasks": names},
        )


def _session_scope_tasks(app: Celery) -> list[str]:
    found: list[str] = []
    for name, task in sorted(app.tasks.items()):
        if isinstance(task, PgLockMixin) and not name.startswith(BUILTIN_PREFIX):
            with contextlib.suppress(ConfigurationError):  # reported when the task runs
                if task.pglock_options().scope == "session":
                    found.append(name)
    return found


@celery_signals.worker_process_init.connect
def _open_pool_after_fork(**_: Any) -> None:
    # Prefork child: build this process's own pool now rather than on the first task,
    # unless forked before the start-up check passed (PostgreSQL may be away meanwhile).
    serve_tasks()
    app = _current_app_with_pglock()
    if app is not None and _checked:
        try:
            database(app_settings(app))
        except PgLockError as exc:  # the first task will retry and report
            logger.error(
                "celery-pglock could not connect after fork: %s",
                exc,
                extra={"action": "pglock_db_unavailable"},
            )


@celery_signals.task_failure.connect
def _record_worker_lost(
    sender: Any = None,
    exception: BaseException | None = None,
    args: Any = None,
    kwargs: Any = None,
    **_: Any,
) -> None:
    # Sent in the worker's MAIN process when a pool child died mid-task (SIGKILL, OOM
    # killer) and the message is not requeued (acks_late off, or no reject_on_worker_lost);
    # the request's context is on the task's request stack. Without this the attempt's row
    # would stay `running` until the slot's next message re-claims it.
    if not isinstance(exception, WorkerLostError) or not isinstance(sender, PgLockMixin):
        return
    if sender.name.startswith(BUILTIN_PREFIX) or not locking(sender.app):
        return
    try:
        claim = sender.pglock_message_claim(args or (), kwargs or {})
        token = None
        if claim is not None and claim.slot is not None:  # a row to record the death in
            reason = f"worker lost: {exception}"
            token = record_worker_lost(app_settings(sender.app), claim, reason)
    except Exception:
        logger.exception(
            "could not record the lost worker of %s[%s]",
            sender.name,
            sender.request.id,
            extra={"action": "pglock_failure_not_recorded"},
        )
        return
    if token is not None:
        logger.warning(
            "%s[%s]: its worker process died; attempt (token %d) recorded failed",
            sender.name,
            sender.request.id,
            token,
            extra={"action": "pglock_worker_lost", "token": token},
        )


@celery_signals.worker_process_shutdown.connect
def _close_pool(**_: Any) -> None:
    close_all()


def _current_app_with_pglock() -> Celery | None:
    from celery import current_app  # noqa: PLC0415

    app: Celery = current_app._get_current_object()  # type: ignore[attr-defined]
    has_locked = any(isinstance(task, PgLockMixin) for task in app.tasks.values())
    return app if has_locked and locking(app) else None


__all__ = ["StartupCheck"]
