"""``celery -A proj pglock pause|resume|trigger|why``: steer beat entries, explain a slot.

Entries are the beat schedule's as the app's ``beat_scheduler`` loads it (a class with
``PgLockSchedulerMixin``: ``PgLockScheduler``'s ``beat_schedule``, or django-celery-beat's
periodic tasks by name). The commands are thin shells around ``steering.actions``, the
dashboard's too.
"""

from __future__ import annotations

import click

from celery_pglock import ops
from celery_pglock.cli import _output as output
from celery_pglock.cli._common import (
    connection,
    current_app,
    json_option,
    operator_of,
    reported_errors,
    resolve_lock,
)
from celery_pglock.cli._entries import BY_HELP, checked
from celery_pglock.steering import _reads as reads
from celery_pglock.steering import _replay as replay
from celery_pglock.steering import actions
from celery_pglock.steering._apps import Schedule


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
        done = actions.pause(operator_of(app, by), entry, reason)
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
        op = operator_of(app, by, wait=catch_up)
        done = actions.resume(op, entry, catch_up=catch_up, send=replay.waiting_for_each())
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
    slot = checked(slot) if slot is not None else None
    with reported_errors():
        done = actions.trigger(operator_of(app, by), entry, slot=slot, send=replay.published)
    lock, slot = done["lock_name"], done["slot"]
    if as_json:
        output.echo_json(ops.jsonable(done))
    elif done["send"]:
        task = Schedule(app).entry(entry).task
        click.echo(f"{entry}: sent {task} with slot {slot} (lock {lock})")
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
    with reported_errors(), connection(app) as statements:
        found = reads.why(
            app, statements, name, slot, resolve=lambda given: resolve_lock(app, given)
        )
    if as_json:
        output.echo_json(ops.jsonable(found))
        return
    click.echo(output.why_text(found))
