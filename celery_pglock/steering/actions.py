"""Every operator action in one home: pause, resume, trigger, rerun, backfill, release.

``celery pglock …``, the dashboard and its Django mount act through these functions and
nothing else, so an action checks its input, is audited and sends its slots the same way
whichever face asked. The rules they share (CHANGELOG, issue 33):

- every action is audited as who asked (``Operator.actor``), a release included;
- a time without a UTC offset is refused, never guessed (``moment``);
- resume sends the slots a pause held back only when asked (``catch_up``);
- an action is audited before the first of its slots is sent, so one stopped half-way
  leaves its trail.

How slots go out is the face's choice of ``replay.Send``: the CLI waits for each (their
outcomes fill the plan), the dashboard sends in the background (a page does not wait a
minute); both send one slot at a time, each once the one before ended.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from celery_pglock import _controls as controls
from celery_pglock import ops
from celery_pglock._messages import checked_slot
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.errors import ConfigurationError
from celery_pglock.ops import Row
from celery_pglock.steering import _replay as replay
from celery_pglock.steering._apps import Schedule, lock_of, namespace
from celery_pglock.steering._operator import Operator

BACKFILL_LIMIT = 100  # slots per backfill unless asked for more


class NothingToDo(ConfigurationError):
    """The action has nothing to act on: an entry not paused, a slot not succeeded, a
    lock not held, a range without a slot."""


def moment(text: str) -> datetime:
    """An ISO-8601 time with its UTC offset (``Z``, ``+02:00``), in UTC; a date means its
    start. Without an offset it is ambiguous: refused, with the fix."""
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(f"{text!r} is not an ISO-8601 time") from None
    if parsed.tzinfo is None:
        raise ConfigurationError(f"{text!r} has no UTC offset: add Z or +HH:MM")
    return parsed.astimezone(timezone.utc)


def pause(op: Operator, entry: str, reason: str | None) -> Row:
    """Pause ``entry``: the pause in force (``new`` false when it already was)."""
    Schedule(op.app).entry(entry)
    with op.connection() as statements:
        return controls.pause(statements, op.target, entry, reason)


def resume(op: Operator, entry: str, *, catch_up: bool, send: replay.Send) -> Row:
    """Resume ``entry``; with ``catch_up``, also send the slots the pause held back (the
    newest, at most the entry's catch-up limit), oldest first: ``outcomes`` by slot."""
    schedule = Schedule(op.app)
    found = schedule.entry(entry)
    limit = BeatSettings.from_app(op.app).entry_catch_up(found)[1] if catch_up else 0
    with op.connection() as statements:
        done = controls.resume(statements, op.target, entry, catch_up=limit)
    if done is None:
        raise NothingToDo(f"{entry} is not paused")
    plan = replay.sending(done["caught_up"])
    if plan:
        send(op, found, schedule.lock_name(found), plan)
    return {**done, "outcomes": {item["slot"]: item.get("outcome") for item in plan}}


def trigger(op: Operator, entry: str, *, slot: str | None, send: replay.Send) -> Row:
    """Record one run of ``entry`` (slot ``manual:<now>`` unless given) and send it, unless
    that slot already succeeded (``send`` false)."""
    schedule = Schedule(op.app)
    found = schedule.entry(entry)
    slot = checked_slot("slot", slot) if slot is not None else controls.manual_slot()
    lock = schedule.lock_name(found)
    with op.connection() as statements:
        done = controls.record_trigger(
            statements, op.target, entry=entry, task=found.task, lock_name=lock, slot=slot
        )
    if done["send"]:
        send(op, found, lock, replay.sending([slot]))
    return {**done, "entry": entry, "lock_name": lock, "slot": slot}


def rerun(op: Operator, name: str, slot: str, reason: str, *, send: replay.Send) -> Row:
    """Run one succeeded slot of ``name`` (a beat entry or its lock) once more, on purpose:
    audited with the outcome it had (``previous``); ``outcome`` and ``token`` once known."""
    if not reason.strip():
        raise ConfigurationError("a reason is required: it must say why the slot runs again")
    entry, lock = replay.entry_of(Schedule(op.app), name)
    slot = checked_slot("slot", slot)
    with op.connection() as statements:
        previous = controls.reopen(statements, op.target, lock_name=lock, slot=slot, reason=reason)
    if previous is None:
        raise NothingToDo(
            f"slot {slot} of {lock} has not succeeded: nothing to run again "
            "(send it with `pglock trigger --slot` or `pglock backfill`)"
        )
    [item] = plan = replay.sending([slot])
    send(op, entry, lock, plan)
    done: Row = {"lock_name": lock, "slot": slot, "previous": previous}
    if "outcome" in item:
        with op.connection() as statements:
            row = controls.run_row(statements, lock, slot)
        done.update(outcome=item["outcome"], token=row["token"] if row else None)
    return done


@dataclass(frozen=True)
class Backfill:
    """What a backfill of one entry's range does with each slot (``replay.plan``)."""

    entry: Any
    lock: str
    start: datetime
    end: datetime
    plan: list[dict[str, Any]]

    def as_json(self) -> Row:
        sending = [item["slot"] for item in self.plan if item["action"] == "send"]
        return {
            "entry": self.entry.name,
            "lock_name": self.lock,
            "slots": self.plan,
            "sending": sending,
        }


def backfill_plan(
    op: Operator, entry: str, start: datetime, end: datetime, *, limit: int = BACKFILL_LIMIT
) -> Backfill:
    """The dry run: each slot of ``entry`` in ``[start, end]`` to send or skip, and why."""
    if end < start:
        raise ConfigurationError(f"to ({end:%Y-%m-%dT%H:%M:%SZ}) is before from: swap them")
    schedule = Schedule(op.app)
    found = schedule.entry(entry)
    wanted = replay.slots_between(op.app, found, start, end, limit)
    if not wanted:
        raise NothingToDo(f"{entry} has no slot in that range (see `pglock schedule --from`)")
    lock = schedule.lock_name(found)
    with op.connection() as statements:
        rows = controls.slot_rows(statements, lock, wanted)
    return Backfill(found, lock, start, end, replay.plan(rows, wanted))


def backfill(
    op: Operator,
    entry: str,
    start: datetime,
    end: datetime,
    *,
    send: replay.Send,
    limit: int = BACKFILL_LIMIT,
) -> Backfill:
    """Send ``entry``'s slots in ``[start, end]`` that never succeeded, oldest first,
    audited before the first is sent."""
    found = backfill_plan(op, entry, start, end, limit=limit)
    sent = found.as_json()["sending"]
    with op.connection() as statements:
        controls.audit(
            statements,
            op.target,
            "backfill",
            entry=entry,
            lock_name=found.lock,
            range=[start, end],
            sent=sent,
        )
    send(op, found.entry, found.lock, found.plan)
    return found


def lock_to_release(op: Operator, name: str, *, any_namespace: bool = False) -> str:
    """The lock ``name`` names (a lock or a task name), refused outside the app's
    namespace unless ``any_namespace``."""
    lock = lock_of(op.app, name)
    prefix = f"{namespace(op.app)}:"
    if not lock.startswith(prefix) and not any_namespace:
        raise ConfigurationError(
            f"{lock!r} is outside this app's namespace {prefix!r}; "
            "the CLI releases it with --any-namespace"
        )
    return lock


def release(op: Operator, name: str, *, any_namespace: bool = False) -> ops.ForcedRelease:
    """End the session(s) holding lock ``name`` (a lock or a task name), audited."""
    lock = lock_to_release(op, name, any_namespace=any_namespace)
    with op.connection() as statements:
        done = ops.force_release(statements, lock)
        if done is None or not done.terminated:
            raise NothingToDo(f"lock {lock!r} is not held")
        controls.audit(statements, op.target, "release", lock_name=lock, terminated=done.terminated)
    return done
