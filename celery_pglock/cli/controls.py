"""``celery -A proj pglock pause|resume|trigger|why``: steer beat entries, explain a slot.

Entries are the beat schedule's as the app's ``beat_scheduler`` loads it (a class with
``PgLockSchedulerMixin``: ``PgLockScheduler``'s ``beat_schedule``, or django-celery-beat's
periodic tasks by name). The commands are thin shells around ``celery_pglock.controls``.
"""

from __future__ import annotations

import difflib
from datetime import datetime, timedelta, timezone
from typing import Any

import click
from celery import Celery

from celery_pglock import controls, ops, slots
from celery_pglock.beat.settings import BeatSettings
from celery_pglock.cli import output
from celery_pglock.cli.common import (
    NotFound,
    Refused,
    current_app,
    json_option,
    reported_errors,
    resolve_lock,
    session,
    tables_of,
)
from celery_pglock.cli.entries import BY_HELP, Delivery, checked
from celery_pglock.ops import Row
from celery_pglock.sessions import Connection
from celery_pglock.steering.apps import (
    Schedule,
    app_tasks,
    schedule_or_none,
    send,
    target,
)


@click.command()
@click.argument("entry")
@click.option("--reason", help="Why, for status, why and the audit trail.")
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def pause(
    ctx: click.Context, entry: str, reason: str | None, by: str | None, as_json: bool
) -> None:
    """Stop sending ENTRY's slots: every beat replica obeys at its next tick.

    Slots that fall due meanwhile are recorded `paused`, not sent. The entry itself is
    left as it is (django-celery-beat's `enabled` too): the pause is celery-pglock's.
    """
    app = current_app(ctx)
    with reported_errors():
        Schedule(app).entry(entry)
        with session(app) as (conn, _):
            done = controls.pause(conn, target(app, by), entry, reason)
    if as_json:
        output.echo_json(ops.jsonable(done))
        return
    since = f"paused by {done['paused_by']} at {done['paused_at']:%Y-%m-%d %H:%M:%S %Z}"
    said = f" ({done['reason']})" if done["reason"] else ""
    if not done["new"]:
        click.echo(f"{entry}: already {since}{said}; left as it was")
        return
    click.echo(f"{entry}: {since}{said}. Every beat replica stops sending it at its next tick;")
    click.echo("the schedule entry itself is unchanged (resume with `pglock resume`).")


@click.command()
@click.argument("entry")
@click.option(
    "--catch-up",
    is_flag=True,
    help="Also send the slots held back by the pause (the newest, at most "
    "pglock_beat_catch_up_limit of them), oldest first.",
)
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def resume(ctx: click.Context, entry: str, catch_up: bool, by: str | None, as_json: bool) -> None:
    """Send ENTRY's slots again, from its next due slot on."""
    app = current_app(ctx)
    with reported_errors():
        schedule = Schedule(app)
        found = schedule.entry(entry)
        limit = BeatSettings.from_app(app).entry_catch_up(found)[1] if catch_up else 0
        with session(app, wait=catch_up) as (conn, tables):
            done = controls.resume(conn, target(app, by), entry, catch_up=limit)
            if done is None:
                raise NotFound(f"{entry} is not paused")
            delivery = Delivery(app, conn, tables, found, schedule.lock_name(found))
            outcomes = [delivery.run(slot) for slot in done["caught_up"]]
        done["outcomes"] = dict(zip(done["caught_up"], outcomes, strict=True))
    if as_json:
        output.echo_json(ops.jsonable(done))
        return
    click.echo(f"{entry}: resumed (paused by {done['paused_by']} at {done['paused_at']}).")
    for slot, outcome in done["outcomes"].items():
        click.echo(f"  held-back slot {slot}: {outcome}")


@click.command()
@click.argument("entry")
@click.option("--slot", help="The run's slot [default: manual:<UTC time>]; one slot runs once.")
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def trigger(
    ctx: click.Context, entry: str, slot: str | None, by: str | None, as_json: bool
) -> None:
    """Send one run of ENTRY now. Triggering twice with one --slot runs it once."""
    app = current_app(ctx)
    with reported_errors():
        schedule = Schedule(app)
        found = schedule.entry(entry)
        slot = checked(slot) if slot is not None else controls.manual_slot()
        lock = schedule.lock_name(found)
        with session(app) as (conn, _):
            done = controls.record_trigger(
                conn, target(app, by), entry=entry, task=found.task, lock_name=lock, slot=slot
            )
        if done["send"]:
            send(app, found, slot)
    result = {**done, "entry": entry, "lock_name": lock, "slot": slot}
    if as_json:
        output.echo_json(ops.jsonable(result))
    elif done["send"]:
        click.echo(f"{entry}: sent {found.task} with slot {slot} (lock {lock})")
    else:
        click.echo(
            f"{entry}: slot {slot} already succeeded (token {done['token']}): nothing sent. "
            f"To run it once more on purpose: celery pglock rerun {lock} {slot} --reason …"
        )


@click.command()
@click.argument("name")
@click.argument("slot")
@json_option
@click.pass_context
def why(ctx: click.Context, name: str, slot: str, as_json: bool) -> None:
    """Everything known about one slot of NAME (a beat entry, a task or a lock name):
    was it due, claimed and sent, every attempt and skip, the lock's holder, the audit."""
    app = current_app(ctx)
    with reported_errors():
        schedule = schedule_or_none(app)
        entry = schedule.entries.get(name) if schedule else None
        lock = schedule.lock_name(entry) if schedule and entry else resolve_lock(app, name)
        with session(app) as (conn, _):
            found = controls.why(
                conn, target(app, None), lock_name=lock, slot=slot, entry=name if entry else None
            )
            if entry is None and not _known(app, conn, name, lock, found):
                near = difflib.get_close_matches(name, _names(app, schedule), n=3, cutoff=0.5)
                hint = f": did you mean {', '.join(near)}?" if near else ""
                raise Refused(f"no beat entry, task or lock {name!r} has any slot{hint}")
    found["due"] = _due(entry, slot, app) if entry is not None else None
    if as_json:
        output.echo_json(ops.jsonable(found))
        return
    click.echo(output.why_text(found))


def _known(app: Celery, conn: Connection, name: str, lock: str, found: Row) -> bool:
    """Whether ``name`` is something this app or its ledger knows, whatever the slot."""
    if name in app_tasks(app) or lock != name or found["run"] or found["skips"] or found["sends"]:
        return True
    return controls.lock_has_rows(conn, tables_of(app), lock)


def _names(app: Celery, schedule: Schedule | None) -> list[str]:
    entries = list(schedule.entries) if schedule else []
    return entries + [task for task in app_tasks(app) if not task.startswith("celery.")]


def _due(entry: Any, slot: str, app: Celery) -> str:
    """Whether ``slot`` is an occurrence of the entry's schedule, and when it fell due."""
    try:
        moment = slots.parse_slot(slot)
    except ValueError:
        return "not a time slot: sent by hand (trigger, or a caller's own slot)"
    align = BeatSettings.from_app(app).align_intervals
    found = slots.next_occurrence(
        entry.schedule, moment - timedelta(seconds=1), align_intervals=align
    )
    if found is None or slots.format_slot(found) != slot:
        return f"no: not an occurrence of {entry.schedule!r}"
    return "yes" if found <= datetime.now(timezone.utc) else "not yet"
