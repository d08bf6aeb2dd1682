"""``pglock_check_on_enqueue``: do not publish a slotted message whose slot is already done.

``apply_async`` looks the slot up first (one statement on a pooled connection, no lock):
if it already succeeded, or a live session is running it, nothing is published and the
caller gets a result in state ``SKIPPED`` with the same meta as a worker-side skip. It is
an optimisation, not the guarantee: the worker checks every message again, and when the
look-up itself fails the message is published as if the check were off.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from celery.backends.base import DisabledBackend
from celery.result import EagerResult
from celery.utils import uuid

from celery_pglock import _policy as policy
from celery_pglock import signals
from celery_pglock._config import Settings
from celery_pglock._ledger import enqueued_skip
from celery_pglock._messages import (
    BUILTIN_PREFIX,
    ENTRY_HEADER,
    SLOT_HEADER,
    as_headers,
    message_slot,
)
from celery_pglock._protocol import Claim, Skip
from celery_pglock._states import SKIPPED
from celery_pglock.errors import ConfigurationError, DatabaseError
from celery_pglock.store._database import database

logger = logging.getLogger("celery_pglock")


if TYPE_CHECKING:
    _Eager = EagerResult[Any]
else:  # EagerResult is subscriptable only from Celery 5.7 on
    _Eager = EagerResult


class SkippedResult(_Eager):
    """The result of a message not published, when no result backend can hold it."""

    def get(self, *args: Any, **kwargs: Any) -> Any:
        return self.result


def checks_enqueue(task: Any, options: dict[str, Any]) -> bool:
    """Whether ``task.apply_async(**options)`` looks its slot up before publishing."""
    headers = as_headers(options.get("headers"))
    if (
        task.name.startswith(BUILTIN_PREFIX)
        or options.get("retries")  # self.retry(): the slot is the one running
        or headers.get(ENTRY_HEADER)  # beat claimed the slot before sending it
        or task.app.conf.task_always_eager
    ):
        return False
    try:
        return bool(task.pglock_options().check_on_enqueue)
    except ConfigurationError:
        return False  # a misconfigured task fails in the worker, as it always did


def skipped_before_publish(
    task: Any, settings: Settings, call: tuple[Any, Any], task_id: str | None, options: Any
) -> Any | None:
    """A ``SKIPPED`` result if the message's slot succeeded or is running, else None
    (publish). ``call`` is (args, kwargs); ``options`` those of ``apply_async``."""
    try:
        claim = _claim(task, call, task_id, as_headers(options.get("headers")))
    except ConfigurationError:
        return None  # published: the worker fails it loudly, as without the check
    if claim is None:
        return None
    try:
        skip = enqueued_skip(database(settings), claim)
    except DatabaseError as exc:
        what = f"{task.name} slot {claim.slot}"
        extra = {"action": "pglock_enqueue_check_failed", "lock": claim.lock_name}
        logger.warning(
            "could not check %s before publishing, publishing it: %s", what, exc, extra=extra
        )
        return None
    if skip is None:
        return None
    return _report(task, claim.task_id or "", skip)


def _claim(
    task: Any, call: tuple[Any, Any], task_id: str | None, headers: Mapping[str, Any]
) -> Claim | None:
    options = task.pglock_options()
    slot = message_slot(task.name, options, headers.get(SLOT_HEADER), task_id, call)
    if slot is None:
        return None
    message_id = task_id or uuid()  # the id of the SKIPPED result if not published
    return policy.claim(task.name, options, call, slot=slot, entry=None, task_id=message_id)


def _report(task: Any, task_id: str, skip: Skip) -> Any:
    meta = skip.meta()
    stored = _store(task, task_id, meta)
    signals.task_skipped.send(sender=task, reason=skip.reason, meta=meta)
    holder = meta.get("holder") or {}
    logger.info(
        "not publishing %s[%s]: %s (lock %r, slot %s, holder %s)",
        task.name,
        task_id,
        skip.reason,
        skip.lock_name,
        skip.slot,
        holder.get("task_id"),
        extra={
            "action": "pglock_enqueue_skipped",
            "reason": skip.reason,
            "lock": skip.lock_name,
            "slot": skip.slot,
            "token": skip.token,
        },
    )
    return task.AsyncResult(task_id) if stored else SkippedResult(task_id, meta, SKIPPED)


def _store(task: Any, task_id: str, meta: dict[str, Any]) -> bool:
    """Store ``SKIPPED`` in the result backend; False when there is none."""
    backend = task.backend
    if isinstance(backend, DisabledBackend):
        return False
    try:
        backend.store_result(task_id, meta, SKIPPED)
    except Exception as exc:  # noqa: BLE001 - the caller still gets the skip, in memory
        logger.warning(
            "could not store SKIPPED for %s[%s]: %s",
            task.name,
            task_id,
            exc,
            extra={"action": "pglock_enqueue_store_failed"},
        )
        return False
    return True


__all__ = ["SkippedResult", "checks_enqueue", "skipped_before_publish"]
