"""``pglock_overlap = "buffer_one"``: one slot waits while its lock is held, then runs.

A message that finds every key of its lock held is not skipped: ``decide`` keeps it in
PostgreSQL (the ``waiting`` table: the task's arguments as its serializer encoded them,
the headers that name the slot, where it was sent) and acks it, so it occupies no worker
process while it waits and outlives any worker. At most one slot waits per lock name: a
newer one replaces it (the replaced one is ``SKIPPED``, ``superseded``). The holder that
frees the lock sends the waiting message again (``send_next``), with the same task id,
so that its ``AsyncResult`` follows it; the beat leader sends one whose holder died
(``sweep``). Each slot still runs at most once: the ledger decides as for any
message, and a copy sent twice skips as ``done`` or ``locked``.

Nothing is lost on the way: a waiting slot is decided (``decide``) and its row
committed, and then (``take_turn``) the lock is tried once more. Either that try gets the
lock (and runs the slot itself), or the holder frees it later, and the holder's look for
a waiting slot comes after that.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from kombu import serialization

from celery_pglock._keys import waiting_lock
from celery_pglock._ledger import RunQuery
from celery_pglock._locks import acquire, release
from celery_pglock._messages import ENTRY_HEADER, SLOT_HEADER
from celery_pglock._protocol import Claim, Lease, Skip
from celery_pglock._slots import SLOT_PATTERN
from celery_pglock._values import Scope
from celery_pglock.store._database import Database

logger = logging.getLogger("celery_pglock")

#: The header of a waiting slot's message, sent again when its turn came.
WAITED_HEADER = "pglock_waited"
RESEND_AFTER = 30.0  # seconds: a sent waiting message that has not started is sent again
STRANDED_GRACE = 2.0  # seconds a waiting slot may wait on a free lock before the sweep
STRANDED_LIMIT = 100
MAX_SENDS = 10  # a waiting slot sent this often without starting is given up (failed)
ABANDONED = "abandoned: its waiting message was sent 10 times and never started"
ABANDON_PARAMS = {"max_sends": MAX_SENDS, "resend_after": RESEND_AFTER, "reason": ABANDONED}
# The beat leader's sweep (``stranded_waiting``): waiting slots whose lock nobody holds.
STRANDED_PARAMS = {"grace": STRANDED_GRACE, "resend_after": RESEND_AFTER, "limit": STRANDED_LIMIT}
STRANDED = "nobody holds its lock (its holder died, or the message was lost on its way)"


@dataclass(frozen=True)
class Waiting:
    """A message that waits its turn: its slot runs when the lock is next free."""

    lock_name: str
    slot: str
    holder: dict[str, Any] | None

    def meta(self) -> dict[str, Any]:
        return {"lock": self.lock_name, "slot": self.slot, "holder": self.holder}


@dataclass(frozen=True)
class Decision:
    """What ``decide`` committed for a message that found its lock held: ``waiting`` (it
    waits), ``superseded`` (a newer time slot waits) or ``taken`` (its slot succeeded, or
    a live session runs it); and the slot that waited before it."""

    outcome: str
    other_slot: str | None
    other_task_id: str | None
    replaced_waiting: bool  # that slot still waited, and is now `superseded`

    @property
    def replaced(self) -> tuple[str, str] | None:
        """(slot, task id) of the waiting slot this message replaced, to report at once:
        whatever happens to this message next (it may run the slot itself, or fail on a
        PostgreSQL restart), that one no longer runs, and nothing else would report it."""
        if not self.replaced_waiting or self.other_slot is None or self.other_task_id is None:
            return None
        return self.other_slot, self.other_task_id


@dataclass(frozen=True)
class Message:
    """What runs a waiting slot: the call and where it was sent."""

    task_name: str
    args: Any
    kwargs: Any
    serializer: str
    exchange: str | None
    routing_key: str | None

    def encoded(self) -> dict[str, Any]:
        content_type, content_encoding, body = serialization.dumps(
            (self.args, self.kwargs), serializer=self.serializer
        )
        data = body.encode(content_encoding) if isinstance(body, str) else body
        return {"body": data, "content_type": content_type, "content_encoding": content_encoding}


def decide(db: Database, claim: Claim, message: Message) -> Decision:
    """``claim`` found its lock held: wait, or not (committed, one message at a time per
    lock name). The caller reports ``replaced``, then takes its turn (``take_turn``)."""
    first, second = waiting_lock(claim.lock_name)
    params = {
        **claim.params(),
        **message.encoded(),
        "headers": {SLOT_HEADER: claim.slot, ENTRY_HEADER: claim.entry},
        "exchange": message.exchange,
        "routing_key": message.routing_key,
        "slot_pattern": SLOT_PATTERN,
        "waiting_lock_1": first,
        "waiting_lock_2": second,
    }
    with db.statements() as statements, statements.transaction():
        statements.run("lock_waiting", params)
        row = statements.row("wait_turn", params)
    assert row is not None
    return Decision(
        row["outcome"], row["other_slot"], row["other_task_id"], row["replaced_waiting"]
    )


def take_turn(
    db: Database,
    app: Any,
    claim: Claim,
    decision: Decision,
    *,
    scope: Scope,
    lease_seconds: float | None,
) -> Lease | Skip | Waiting:
    """What ``decision`` means for ``claim``: a ``Lease`` (the lock came free: run it), a
    ``Skip``, or ``Waiting``."""
    if decision.outcome == "taken":  # its slot ran or runs: skipped as usual
        return acquire(db, dataclasses.replace(claim, buffer=False), scope, lease_seconds)
    if decision.outcome == "superseded":
        holder = {"task_id": decision.other_task_id, "slot": decision.other_slot}
        return Skip("superseded", claim.lock_name, claim.slot, holder, None)
    return _try_again(db, app, claim, scope, lease_seconds)


def _try_again(
    db: Database, app: Any, claim: Claim, scope: Scope, lease_seconds: float | None
) -> Lease | Skip | Waiting:
    """Waiting is recorded; the holder may have ended meanwhile: try the lock once more."""
    again = acquire(db, claim, scope, lease_seconds)
    if isinstance(again, Lease):
        return again if forget(db, again.claim) else _superseded_meanwhile(db, app, again)
    if again.reason != "locked":
        forget(db, claim)
        return again
    assert claim.slot is not None
    return Waiting(claim.lock_name, claim.slot, again.holder)


def _superseded_meanwhile(db: Database, app: Any, lease: Lease) -> Skip:
    """The lock came free after we waited, but a newer slot replaced ours in between: it
    is that one's turn."""
    release(db, lease, "skipped", "superseded")
    send_next(db, app, lease.lock)
    return Skip("superseded", lease.lock, lease.slot, None, lease.token)


def forget(db: Database, claim: Claim) -> bool:
    """The waiting slot of ``claim`` started or was skipped: it waits no more. False when
    no slot of ``claim`` was waiting."""
    params = {"lock_name": claim.lock_name, "slot": claim.slot}
    with db.statements() as statements:
        return statements.row("forget_waiting", params) is not None


def replaced_meanwhile(db: Database, claim: Claim) -> str | None:
    """The task id of the message that replaced ``claim``'s waiting slot, if one did."""
    params = {"lock_name": claim.lock_name, "slot": claim.slot, "task_id": claim.task_id}
    with db.statements() as statements:
        row = statements.row("replaced_meanwhile", params)
    return None if row is None else str(row["holder_task_id"])


def send_next(db: Database, app: Any, lock_name: str) -> None:
    """The lock was freed: send its waiting slot's message, if a slot waits."""
    params = {"lock_name": lock_name, "resend_after": RESEND_AFTER}
    with db.statements() as statements:
        rows = statements.rows("send_waiting", params)
    for row in rows:
        _publish(app, row, "its lock was freed")


def sweep(app: Any, run_query: RunQuery) -> None:
    """The beat leader's sweep: give up the waiting slots sent too often without starting
    (recorded failed), and send again those whose lock nobody holds (their holder died,
    or the message was lost on its way)."""
    _report_given_up(run_query("abandon_waiting", ABANDON_PARAMS))
    for row in run_query("stranded_waiting", STRANDED_PARAMS):
        try:
            _publish(app, row, STRANDED)
        except Exception:  # sent again at the next sweep (RESEND_AFTER)
            logger.exception(
                "could not send the waiting slot %s of %s",
                row["slot"],
                row["task_name"],
                extra={"action": "pglock_waiting_not_sent", "slot": row["slot"]},
            )


def _report_given_up(rows: list[dict[str, Any]]) -> None:
    """Log the waiting slots the beat leader's sweep gave up (``abandon_waiting``)."""
    for row in rows:
        lock_name, slot = row["lock_name"], row["slot"]
        logger.error(
            "gave up the waiting slot %s of %s[%s] (lock %r): sent %d times, it never "
            "started (is the task registered on a worker that consumes its queue?); its "
            "ledger row is failed",
            slot,
            row["task_name"],
            row["task_id"],
            lock_name,
            row["sends"],
            extra={"action": "pglock_waiting_abandoned", "lock": lock_name, "slot": slot},
        )


def _publish(app: Any, row: dict[str, Any], why: str) -> None:
    task_id, task_name, slot = row["task_id"], row["task_name"], row["slot"]
    content_type, key = row["content_type"], row["routing_key"]
    args, kwargs = serialization.loads(
        bytes(row["body"]), content_type, row["content_encoding"], accept={content_type}
    )
    options = {"exchange": row["exchange"], "routing_key": key} if key else {}
    app.send_task(
        task_name,
        args=args,
        kwargs=kwargs,
        task_id=task_id,
        headers={**row["headers"], WAITED_HEADER: True},
        serializer=serialization.registry.type_to_name[content_type],  # type: ignore[attr-defined]
        **options,
    )
    logger.info(
        "sent the waiting slot %s of %s[%s]: %s",
        slot,
        task_name,
        task_id,
        why,
        extra={"action": "pglock_waiting_sent", "slot": slot, "task_id": task_id},
    )


def superseded_meta(lock: str, replaced: tuple[str, str], by: Claim) -> dict[str, Any]:
    """The ``SKIPPED`` meta of the waiting slot ``replaced`` (slot, task id), replaced by
    the message of ``by``."""
    return {
        **superseded_by(lock, replaced, by.task_id),
        "holder": {"task_id": by.task_id, "slot": by.slot},
    }


def superseded_by(lock: str, replaced: tuple[str, str], task_id: str | None) -> dict[str, Any]:
    """The ``SKIPPED`` meta of the waiting slot ``replaced`` (slot, task id), replaced by
    message ``task_id`` (its slot unknown here)."""
    return {
        "reason": "superseded",
        "lock": lock,
        "slot": replaced[0],
        "holder": {"task_id": task_id},
        "token": None,
    }


__all__ = [
    "WAITED_HEADER",
    "Decision",
    "Message",
    "Waiting",
    "decide",
    "forget",
    "replaced_meanwhile",
    "send_next",
    "superseded_by",
    "superseded_meta",
    "sweep",
    "take_turn",
]
