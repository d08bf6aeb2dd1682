"""What a task reports under ``pglock_overlap = "buffer_one"`` (``waiting``).

The message to keep for a slot that waits (``message_of``), the ``WAITING`` state of the
one that waits (``report_waiting``) and the ``SKIPPED`` state of the one it replaced
(``report_replaced``): the Celery side of ``waiting``, for ``PgLockMixin.__call__``.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery.exceptions import Ignore

from celery_pglock import waiting
from celery_pglock.protocol import Claim
from celery_pglock.states import SKIPPED, WAITING

logger = logging.getLogger("celery_pglock")


def message_of(task: Any, args: Any, kwargs: Any) -> waiting.Message:
    """What runs the slot of ``task``'s current message again: its call, and where it came by."""
    delivery = getattr(task.request, "delivery_info", None) or {}
    return waiting.Message(
        task_name=task.name,
        args=list(args),
        kwargs=dict(kwargs),
        serializer=getattr(task, "serializer", None) or task.app.conf.task_serializer,
        exchange=delivery.get("exchange"),
        routing_key=delivery.get("routing_key"),
    )


def report_replaced(task: Any, replaced: tuple[str, str] | None, claim: Claim) -> None:
    """Mark the waiting slot (slot, task id) that ``claim`` replaced ``SKIPPED``
    (``superseded``) in the result backend; the ledger and the skips table say it already."""
    if replaced is None:
        return
    slot, task_id = replaced
    meta = waiting.superseded_meta(claim.lock_name, replaced, claim)
    try:
        task.backend.store_result(task_id, meta, SKIPPED)
    except Exception:  # the result backend is down: the ledger still says it
        logger.exception(
            "could not store the SKIPPED state of %s",
            task_id,
            extra={"action": "pglock_skip_not_stored"},
        )
    logger.info(
        "%s[%s] (slot %s) replaces the waiting slot %s [%s]: superseded",
        task.name,
        task.request.id,
        claim.slot,
        slot,
        task_id,
        extra={
            "action": "pglock_task_skipped",
            "reason": "superseded",
            "lock": claim.lock_name,
            "slot": slot,
            "token": None,
        },
    )


def report_waiting(task: Any, turn: waiting.Waiting) -> NoReturn:
    """The message waits its turn: state ``WAITING``, one INFO line, and acked (``Ignore``)."""
    task.update_state(state=WAITING, meta=turn.meta())
    holder = turn.holder or {}
    logger.info(
        "%s[%s] waits its turn: lock %r is held (holder %s); slot %s runs when it is freed",
        task.name,
        task.request.id,
        turn.lock,
        holder.get("task_id"),
        turn.slot,
        extra={"action": "pglock_task_waiting", "lock": turn.lock, "slot": turn.slot},
    )
    raise Ignore()


__all__ = ["message_of", "report_replaced", "report_waiting"]
