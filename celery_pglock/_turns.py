"""``pglock_overlap = "buffer_one"`` as a locked task sees it: the one interface of
``waiting`` for ``PgLockMixin``.

After its claim, a message takes its turn (``take_turn``): one that found its lock held
waits (its message kept, ``WAITING``), and the slot it replaced is reported ``SKIPPED``;
one that runs, or a waiting slot's copy that was skipped, waits no more. When a run frees
its lock it passes the turn on (``pass_on``): the waiting slot is sent. ``own_copy``
tells a waiting slot's copy that finds its slot run by its own task id (its result is
that run's, not a skip).
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from celery.exceptions import Ignore

from celery_pglock import _waiting as waiting
from celery_pglock._config import TaskOptions
from celery_pglock._messages import headers_of
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._runs import settle_failure
from celery_pglock._states import SKIPPED, WAITING
from celery_pglock.errors import DatabaseUnavailable
from celery_pglock.store._database import Database

logger = logging.getLogger("celery_pglock")


Outcome = Lease | Skip | waiting.Waiting


def take_turn(
    task: Any,
    db: Database,
    claim: Claim,
    outcome: Lease | Skip,
    *,
    options: TaskOptions,
    call: tuple[Any, Any],
) -> Outcome:
    """``outcome`` of ``claim`` under ``buffer_one``: a message that found its lock held
    waits (or, the lock free meanwhile, runs); one that runs, or a waiting slot's copy
    that was skipped, waits no more. Without the policy, ``outcome`` as it is. ``call``:
    the message's args and kwargs, kept with a slot that waits."""
    if not claim.buffer:
        return outcome
    if isinstance(outcome, Skip) and outcome.reason == "locked":
        decision = waiting.decide(db, claim, message_of(task, *call))
        report_replaced(task, decision.replaced, claim)
        return waiting.take_turn(
            db, task.app, claim, decision, scope=options.scope, lease_seconds=options.lease
        )
    if isinstance(outcome, Lease) or is_copy(task):
        _forget(db, claim, outcome)
    return outcome


def _forget(db: Database, claim: Claim, outcome: Lease | Skip) -> None:
    """Its slot runs, or was skipped: it waits no more. A granted lock is given back
    (recorded failed, nothing ran) when PostgreSQL fails meanwhile: the message is then
    retried, where the lock would otherwise stay held for good (its heartbeat keeps the
    session alive) and every later slot wait behind it."""
    try:
        waiting.forget(db, claim)
    except DatabaseUnavailable as exc:
        if isinstance(outcome, Lease):
            settle_failure(db, outcome, exc)
        raise


def own_copy(task: Any, claim: Claim, skip: Skip) -> bool:
    """A waiting slot's copy (same task id) that finds the slot run, or running, by that
    very task id: the run's own result is the caller's, not this skip."""
    holder = (skip.holder or {}).get("task_id")
    copy = claim.buffer and is_copy(task)
    return copy and holder is not None and holder == task.request.id


def is_copy(task: Any) -> bool:
    """Whether ``task``'s message is a waiting slot's, sent again when its turn came."""
    request = task.request
    header = waiting.WAITED_HEADER
    return bool(headers_of(request).get(header) or getattr(request, header, None))


def pass_on(db: Database, app: Any, lease: Lease) -> None:
    """``lease``'s lock is free: send the slot that waits for it, if any (a failure to
    send is logged: the beat leader's sweep, or the lock's next holder, sends it)."""
    if not lease.claim.buffer:
        return
    try:
        waiting.send_next(db, app, lease.lock)
    except Exception:
        logger.exception(
            "could not send the waiting slot of %r",
            lease.lock,
            extra={"action": "pglock_waiting_not_sent", "lock": lease.lock},
        )


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


def report_waiting(task: Any, db: Database, claim: Claim, turn: waiting.Waiting) -> NoReturn:
    """The message waits its turn: state ``WAITING``, one INFO line, and acked (``Ignore``).
    A newer slot may have replaced it meanwhile and said so (``SKIPPED``) before this
    ``WAITING`` landed: then it says ``SKIPPED`` again, last."""
    task.update_state(state=WAITING, meta=turn.meta())
    try:
        by = waiting.replaced_meanwhile(db, claim)
    except DatabaseUnavailable:  # the replacer's SKIPPED stands, unless it came first
        by = None
    if by is not None:
        replaced = (turn.slot, task.request.id)
        task.update_state(state=SKIPPED, meta=waiting.superseded_by(claim.lock_name, replaced, by))
        raise Ignore()
    holder = turn.holder or {}
    logger.info(
        "%s[%s] waits its turn: lock %r is held (holder %s); slot %s runs when it is freed",
        task.name,
        task.request.id,
        turn.lock_name,
        holder.get("task_id"),
        turn.slot,
        extra={"action": "pglock_task_waiting", "lock": turn.lock_name, "slot": turn.slot},
    )
    raise Ignore()


__all__ = ["Outcome", "own_copy", "pass_on", "report_waiting", "take_turn"]
