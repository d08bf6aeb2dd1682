"""``PgLockMixin`` / ``PgLockTask``: run each (lock name, slot) once, skip duplicates loudly.

The tracer calls ``Task.__call__`` (not ``run``) when a class overrides it, so wrapping
``__call__`` in try/finally is the one hook that surrounds the body and always releases;
``after_return`` is skipped on ``retry()``, ``Ignore`` and ``Reject``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, NoReturn

import celery
from celery import Celery, Task
from celery.exceptions import Ignore, Reject

from celery_pglock import _policy as policy
from celery_pglock import _rogue as rogue
from celery_pglock import _runs as runs
from celery_pglock import _turns as turns
from celery_pglock import signals
from celery_pglock._config import TaskOptions, app_settings, enabled_setting, locked_app_wide
from celery_pglock._enqueue import SkippedResult, checks_enqueue, skipped_before_publish
from celery_pglock._events import send_skipped
from celery_pglock._locks import acquire
from celery_pglock._messages import (
    BUILTIN_PREFIX,
    ENTRY_HEADER,
    MANUAL_HEADER,
    SLOT_HEADER,
    as_headers,
    checked_slot,
    headers_of,
    message_slot,
)
from celery_pglock._outage import OutageLog
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._states import SKIPPED
from celery_pglock.errors import (
    DatabaseError,
    DatabaseUnavailable,
    TaskSkipped,
    WaitEnded,
)
from celery_pglock.store._database import Database, database, serving_tasks

logger = logging.getLogger("celery_pglock")

MAX_DB_RETRY_COUNTDOWN = 60.0
# The worker's start-up step (``celery_pglock._worker``), named: Celery loads steps by name.
STARTUP_STEP = "celery_pglock._worker:StartupCheck"
CELERY_KEEPS_REQUEST = celery.VERSION[:2] >= (5, 5)  # Task.push_request copies the request

_outage = OutageLog(logger, "pglock_db_back")  # per process: one ERROR line per outage


class _Running(threading.local):
    """The leases of the executions running in this thread (greenlet), by task name.

    Not an attribute of the request: ``Task.__call__`` copies the request's attributes into
    the body's request, and Celery copies those into the message of a ``retry()``, where a
    lease is not serializable (the retry would be lost).
    """

    def __init__(self) -> None:
        self.leases: dict[str, list[Lease]] = {}
        # A running execution's own retry, by task id, published once its lock is freed.
        self.retries: dict[str, Callable[[], Any]] = {}
        # The requests (by id) whose body runs in this thread: the tracer's call of each.
        self.bodies: set[int] = set()

    def holds(self, lock_name: str) -> bool:
        return any(lease.lock == lock_name for stack in self.leases.values() for lease in stack)


_running = _Running()
# Eager calls (``apply``): the meta of a skip, by task id, until ``apply`` returns it.
_eager_skips: dict[str, dict[str, Any]] = {}
_warned_property_slot: set[str] = set()  # task names, once per process
ENABLED_SETTING = "pglock_enabled"
_said_disabled: weakref.WeakSet[Celery] = weakref.WeakSet()  # apps told, once per process


class PgLockMixin:
    """Adds PostgreSQL locking to a Task class; put it before ``Task`` in the bases.

    Options are task attributes (``@app.task(pglock_scope="transaction")``) and default to
    ``app.conf.pglock_*``: ``pglock_key``, ``pglock_namespace``, ``pglock_scope``,
    ``pglock_slot``, ``pglock_lease``, ``pglock_scheduled_only``, ``pglock_on_db_error``,
    ``pglock_db_max_retries``, ``pglock_coalesce``, ``pglock_max_lateness``,
    ``pglock_check_on_enqueue``, ``pglock_overlap``, ``pglock_concurrency``.
    """

    pglock_key: ClassVar[str | Callable[..., str] | None] = None
    pglock_namespace: ClassVar[str | None] = None
    pglock_scope: ClassVar[str | None] = None
    pglock_slot: ClassVar[str | Callable[..., Any] | None] = None
    pglock_lease: ClassVar[float | None] = None
    pglock_scheduled_only: ClassVar[bool | None] = None
    pglock_on_db_error: ClassVar[str | None] = None
    pglock_db_max_retries: ClassVar[int | None] = None
    pglock_coalesce: ClassVar[str | None] = None
    pglock_max_lateness: ClassVar[float | None] = None
    pglock_check_on_enqueue: ClassVar[bool | None] = None
    pglock_overlap: ClassVar[str | None] = None
    pglock_concurrency: ClassVar[int | None] = None

    _pglock_options: TaskOptions | None = None

    # Provided by celery.Task.
    app: Celery
    name: str
    request: Any
    request_stack: Any
    run: Callable[..., Any]
    update_state: Callable[..., None]
    send_event: Callable[..., None]
    retry: Callable[..., Any]
    AsyncResult: Callable[..., Any]

    @classmethod
    def on_bound(cls, app: Celery) -> None:
        super().on_bound(app)  # type: ignore[misc]
        app.steps["worker"].add(STARTUP_STEP)

    @property
    def pglock(self) -> Lease | None:
        """The lock of the execution running in this thread (None when unlocked)."""
        stack = _running.leases.get(self.name)
        return stack[-1] if stack else None

    def pglock_options(self) -> TaskOptions:
        if self._pglock_options is None:
            app = self.app
            app_wide = locked_app_wide(self)
            self._pglock_options = TaskOptions.resolve(self, app.conf, app.main, app_wide=app_wide)
        return self._pglock_options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.name.startswith(BUILTIN_PREFIX) or not locking(self.app):
            # With task_cls = PgLockTask, Celery's own tasks (chord_unlock, backend_cleanup)
            # inherit this class too; locking them would stall chords.
            return self._pglock_body(args, kwargs)
        options = self.pglock_options()
        slot = self._pglock_slot(options, args, kwargs)
        entry = self._pglock_header(ENTRY_HEADER)
        if slot is None:
            self._pglock_slotless(options, entry)
        if not policy.locks(options, slot, entry):
            return self._pglock_body(args, kwargs)  # distinct work: nothing to dedupe
        claim = self._pglock_claim(options, slot, entry, (args, kwargs))
        if _running.holds(claim.lock_name):
            # Called from inside the run that holds this lock (a task calling itself):
            # re-entrance, as a session re-enters its advisory lock, not a duplicate.
            return self._pglock_body(args, kwargs)
        try:
            db = self._pglock_database()
            claimed = acquire(db, claim, options.scope, options.lease)
            call = (args, kwargs)
            outcome = turns.take_turn(self, db, claim, claimed, options=options, call=call)
        except (DatabaseUnavailable, WaitEnded) as exc:  # WaitEnded: cut short by the server
            return self._pglock_db_error(options, exc, args, kwargs)
        _outage.succeeded()
        if isinstance(outcome, Lease):
            return self._pglock_run(db, outcome, args, kwargs)
        if isinstance(outcome, Skip):
            self._pglock_report_skip(outcome, own_copy=turns.own_copy(self, claim, outcome))
        return turns.report_waiting(self, db, claim, outcome)

    def _pglock_claim(
        self, options: TaskOptions, slot: str | None, entry: str | None, call: tuple[Any, Any]
    ) -> Claim:
        """This message's claim, by the rule of ``policy`` (what it locks)."""
        request = self.request
        return policy.claim(
            self.name,
            options,
            call,
            slot=slot,
            entry=entry,
            task_id=request.id,
            manual=bool(self._pglock_header(MANUAL_HEADER)),
            eager=bool(request.called_directly or request.is_eager),
        )

    def _pglock_run(self, db: Database, lease: Lease, args: Any, kwargs: Any) -> Any:
        signals.lock_acquired.send(sender=self, lock=lease.lock, slot=lease.slot, token=lease.token)
        stack = _running.leases.setdefault(self.name, [])
        stack.append(lease)
        try:
            result = self._pglock_body(args, kwargs)
        except TaskSkipped as skipped:
            runs.settle_success(db, lease, f"skipped by the task: {skipped.reason}")
            self._pglock_freed(db, lease)
            self._pglock_report_skip(
                Skip(skipped.reason, lease.lock, lease.slot, None, lease.token), **skipped.meta
            )
        except BaseException as exc:
            runs.settle_failure(db, lease, exc)
            self._pglock_freed(db, lease)
            raise
        finally:
            stack.pop()
        try:
            runs.settle_success(db, lease)
        finally:
            self._pglock_freed(db, lease)
        return result

    def _pglock_freed(self, db: Database, lease: Lease) -> None:
        """The lock is free: publish what waited for that (under ``buffer_one`` the slot
        that waits its turn, and the run's own retry)."""
        turns.pass_on(db, self.app, lease)
        _publish_retry(lease)

    def _pglock_body(self, args: Any, kwargs: Any) -> Any:
        """Run the task's body. Called by Celery's tracer, whose request (and task) are on
        the stacks already: ``run`` directly, as the tracer does for a task without its own
        ``__call__``. Called directly (``task()``): Celery's ``__call__`` pushes them."""
        request = self.request_stack.top
        bodies = _running.bodies
        if request is None or request.called_directly or id(request) in bodies:
            # A direct call, or one nested in this request's own body (a task calling
            # itself): Celery's __call__ pushes the call's own request.
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        bodies.add(id(request))
        try:
            return self.run(*args, **kwargs)
        finally:
            bodies.discard(id(request))

    def pglock_message_claim(self, args: Any, kwargs: Any) -> Claim | None:
        """The claim the current message (``args``, ``kwargs``) makes, as ``__call__`` makes
        it; None when it takes no lock (distinct work)."""
        options = self.pglock_options()
        slot = self._pglock_slot(options, args, kwargs)
        entry = self._pglock_header(ENTRY_HEADER)
        if not policy.locks(options, slot, entry):
            return None
        return self._pglock_claim(options, slot, entry, (args, kwargs))

    def _pglock_database(self) -> Database:
        """This process's ``Database`` for the app (pooled in a worker, see ``serve_tasks``)."""
        return database(app_settings(self.app), keep_connections=serving_tasks())

    def _pglock_slotless(self, options: TaskOptions, entry: str | None) -> None:
        """A message without a slot: a stock beat still sending this task? (``rogue``)"""
        if not self.request.called_directly and not self.request.is_eager:
            locked = policy.locks(options, None, entry)
            rogue.watch.slotless(self, options.namespace, self._pglock_database, locked=locked)

    def _pglock_header(self, name: str) -> Any:
        return headers_of(self.request).get(name) or getattr(self.request, name, None)

    def _pglock_slot(self, options: TaskOptions, args: Any, kwargs: Any) -> str | None:
        slot = self._pglock_header(SLOT_HEADER)
        if slot is None:
            slot = self._pglock_slot_property()
        return message_slot(self.name, options, slot, self.request.id, (args, kwargs))

    def _pglock_slot_property(self) -> Any:
        # `apply_async(pglock_slot=...)` from a process that never imported celery_pglock
        # (which moves it into the headers): Celery sent it as a message property, which
        # Redis keeps and RabbitMQ drops. Use it, and say how to make it reliable.
        slot = as_headers(getattr(self.request, "properties", None)).get(SLOT_HEADER)
        if slot is not None and self.name not in _warned_property_slot:
            _warned_property_slot.add(self.name)
            logger.warning(
                "%s: its pglock_slot came as a message property, not a header: the sender "
                "did not import celery_pglock, and a broker that drops unknown properties "
                "(RabbitMQ) loses the slot. Import celery_pglock in the sending process, "
                "or send headers={'pglock_slot': ...}",
                self.name,
                extra={"action": "pglock_slot_as_property", "task": self.name},
            )
        return slot

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        *rest: Any,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``, plus ``pglock_slot=``: the message's slot (sent as the
        ``pglock_slot`` header), and ``pglock_adhoc=True``: a deliberate call without a slot
        of a task a beat entry sends (not reported as a stock beat's). With
        ``pglock_check_on_enqueue``, a slotted message whose slot already succeeded or is
        running is not published (state ``SKIPPED``)."""
        if "pglock_slot" in options:
            options["headers"] = self._pglock_slot_header(options.pop("pglock_slot"), options)
        if options.pop(rogue.ADHOC_HEADER, False):  # a deliberate call without a slot
            options["headers"] = {**as_headers(options.get("headers")), rogue.ADHOC_HEADER: True}
        retry = bool(options.get("retries"))  # self.retry() of a running execution
        if retry and self._pglock_defer_retry(args, kwargs, task_id, rest, options):
            return self.AsyncResult(task_id)
        if checks_enqueue(self, options) and locking(self.app):
            call = (args or (), kwargs or {})
            skipped = skipped_before_publish(self, app_settings(self.app), call, task_id, options)
            if skipped is not None:
                return skipped
        return super().apply_async(args, kwargs, task_id, *rest, **options)  # type: ignore[misc]

    def _pglock_defer_retry(
        self, args: Any, kwargs: Any, task_id: str | None, rest: Any, options: dict[str, Any]
    ) -> bool:
        """Hold back ``self.retry()``'s message until this execution freed its lock: sent
        at once, another worker process takes it while the lock is still held and skips
        it as ``locked``, and the retry is lost."""
        lease = self.pglock
        if lease is None or task_id is None or lease.claim.task_id != task_id:
            return False
        publish = super().apply_async  # type: ignore[misc]
        _running.retries[task_id] = lambda: publish(args, kwargs, task_id, *rest, **options)
        return True

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Celery's ``push_request``. The request ``Task.__call__`` pushes keeps the current
        one's fields, as Celery does from 5.5 on: before, the body of an eager call saw no
        id and no headers."""
        if args or CELERY_KEEPS_REQUEST:  # the tracer pushes its request positionally
            super().push_request(*args, **kwargs)  # type: ignore[misc]
        else:
            super().push_request(**{**vars(self.request), **kwargs})  # type: ignore[misc]

    def apply(self, *args: Any, **options: Any) -> Any:
        """Celery's eager ``apply``; a skipped duplicate's result is ``SKIPPED`` with the
        same meta as in a worker (Celery alone would report ``IGNORED`` and ``None``)."""
        result = super().apply(*args, **options)  # type: ignore[misc]
        meta = _eager_skips.pop(result.id, None)
        return result if meta is None else SkippedResult(result.id, meta, SKIPPED)

    def _pglock_slot_header(self, slot: Any, options: dict[str, Any]) -> dict[str, Any]:
        headers = dict(as_headers(options.get("headers")))
        if slot is not None:
            headers[SLOT_HEADER] = checked_slot(self.name, slot)
        return headers

    def _pglock_report_skip(self, skip: Skip, *, own_copy: bool = False, **extra: Any) -> NoReturn:
        meta = {**skip.meta(), **extra}
        if self.request.id and self.request.is_eager:
            _eager_skips[self.request.id] = meta
        elif self.request.id and not own_copy:
            self.update_state(state=SKIPPED, meta=meta)
            send_skipped(self, meta)
        signals.task_skipped.send(sender=self, reason=skip.reason, meta=meta)
        holder = meta.get("holder") or {}
        logger.info(
            "skipped %s[%s]: %s (lock %r, slot %s, holder %s)",
            self.name,
            self.request.id,
            skip.reason,
            skip.lock_name,
            skip.slot,
            holder.get("task_id"),
            extra={
                "action": "pglock_task_skipped",
                "reason": skip.reason,
                "lock": skip.lock_name,
                "slot": skip.slot,
                "token": skip.token,
            },
        )
        raise Ignore()

    def _pglock_db_error(
        self, options: TaskOptions, exc: DatabaseError, args: Any, kwargs: Any
    ) -> Any:
        on_error = options.on_db_error
        if on_error == "run":
            logger.warning(
                "running %s[%s] WITHOUT a lock (pglock_on_db_error='run'): %s",
                self.name,
                self.request.id,
                exc,
                extra={"action": "pglock_ran_unlocked"},
            )
            return self._pglock_body(args, kwargs)
        if on_error == "fail" or self.request.called_directly or self.request.is_eager:
            logger.log(
                _outage.failed(),
                "%s[%s] failed: %s",
                self.name,
                self.request.id,
                exc,
                extra={"action": "pglock_db_error_fail"},
            )
            raise exc
        retries = self.request.retries or 0
        countdown = min(MAX_DB_RETRY_COUNTDOWN, 2.0**retries)
        logger.log(
            _outage.failed(),
            "%s[%s] will be retried in %.0f s (attempt %d of %d): %s",
            self.name,
            self.request.id,
            countdown,
            retries + 1,
            options.db_max_retries,
            exc,
            extra={"action": "pglock_db_error_retry"},
        )
        raise self.retry(exc=exc, countdown=countdown, max_retries=options.db_max_retries)


def locking(app: Celery) -> bool:
    """Whether ``app``'s locked tasks lock: ``pglock_enabled`` (the test mode is False)."""
    if enabled_setting(app.conf, ENABLED_SETTING):
        return True
    if app not in _said_disabled:
        _said_disabled.add(app)
        logger.warning(
            "celery-pglock is off (pglock_enabled = False): the tasks of app %r run "
            "unlocked and without PostgreSQL, and duplicates of a slot run again. This is "
            "the test mode, for test suites only",
            app.main,
            extra={"action": "pglock_disabled"},
        )
    return False


class PgLockTask(PgLockMixin, Task):  # type: ignore[misc,type-arg]
    """A Celery Task that runs each (lock name, slot) at most once at a time and once ever."""


def _publish_retry(lease: Lease) -> None:
    """Publish the retry the execution of ``lease`` asked for, now that its lock is free."""
    publish = _running.retries.pop(lease.claim.task_id or "", None)
    if publish is None:
        return
    try:
        publish()
    except Exception as exc:
        # What Task.retry does when its publish fails: the message is not requeued.
        raise Reject(exc, requeue=False) from exc


__all__ = ["PgLockMixin", "PgLockTask", "locking"]
