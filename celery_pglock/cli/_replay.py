"""``celery -A proj pglock schedule|backfill|rerun``: the slots to come, and slots run again.

``schedule`` shows what every beat replica will send; ``backfill`` sends an entry's past
slots that never succeeded (the ledger says which), oldest first, at a bounded rate;
``rerun`` runs one succeeded slot once more, on purpose, with its audit row.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import click

from celery_pglock import _preview as preview
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.cli import _output as output
from celery_pglock.cli._common import (
    Refused,
    current_app,
    json_option,
    operator_of,
    reported_errors,
)
from celery_pglock.cli._entries import BY_HELP
from celery_pglock.errors import ConfigurationError
from celery_pglock.steering import _replay as replay
from celery_pglock.steering import actions
from celery_pglock.steering._apps import Schedule

BACKFILL_LIMIT = actions.BACKFILL_LIMIT  # slots per backfill unless --limit says more
DAY = timedelta(days=1)


def moment(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """An ISO-8601 time with its UTC offset (``Z`` or ``+02:00``); a date means its start."""
    if value is None:
        return None
    try:
        return actions.moment(value)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command()
@click.option("--entry", "name", help="Only this entry.")
@click.option("--next", "count", default=5, show_default=True, type=click.IntRange(1, 1000))
@click.option("--from", "start", callback=moment, help="From this time [default: now].")
@json_option
@click.pass_context
def schedule(
    ctx: click.Context, name: str | None, count: int, start: datetime | None, as_json: bool
) -> None:
    """The next slots of each beat entry, as every replica computes them: UTC and the
    schedule's own wall time, and what a DST switch does to an occurrence."""
    app = current_app(ctx)
    align = BeatSettings.from_app(app).align_intervals
    with reported_errors():
        entries = Schedule(app)
        chosen = [entries.entry(name)] if name else list(entries.entries.values())
    after = start or datetime.now(timezone.utc)
    found = {entry.name: _preview(entry, after, count, align) for entry in chosen}
    if as_json:
        output.echo_json(found)
        return
    for entry in chosen:
        click.echo(f"{entry.name}: {entry.task}, {entry.schedule!r}")
        rows = [(o["slot"], o["local"], o["note"]) for o in found[entry.name]]
        click.echo(output.table(("SLOT", "WALL TIME", "NOTE"), rows) if rows else _no_slots())
        click.echo("")


def _preview(entry: Any, after: datetime, count: int, align: bool) -> list[dict[str, Any]]:
    return [
        {"slot": o.slot, "local": o.local.strftime("%Y-%m-%d %H:%M:%S %Z"), "note": o.note}
        for o in preview.upcoming(entry.schedule, after, count, align_intervals=align)
    ]


def _no_slots() -> str:
    return "  (no slot this library can compute: a custom schedule, or unaligned intervals)"


@click.command()
@click.argument("entry")
@click.option("--from", "start", callback=moment, required=True, help="First time (ISO-8601).")
@click.option("--to", "end", callback=moment, required=True, help="Last time (ISO-8601).")
@click.option("--dry-run", is_flag=True, help="List what would be sent and skipped; send nothing.")
@click.option(
    "--limit",
    default=BACKFILL_LIMIT,
    show_default=True,
    type=click.IntRange(min=1),
    help="Refuse a range holding more slots than this.",
)
@click.option(
    "--rate",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="At most this many slots sent per second.",
)
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def backfill(
    ctx: click.Context,
    *,
    entry: str,
    start: datetime,
    end: datetime,
    dry_run: bool,
    limit: int,
    rate: float,
    by: str | None,
    as_json: bool,
) -> None:
    """Send ENTRY's slots from --from to --to, oldest first, each once it is its turn,
    skipping every slot that already succeeded or runs now."""
    if end < start:
        raise Refused(f"--to ({end:%Y-%m-%dT%H:%M:%SZ}) is before --from: swap them")
    app = current_app(ctx)
    op = operator_of(app, by, wait=not dry_run)
    with reported_errors():
        if dry_run:
            found = actions.backfill_plan(op, entry, start, end, limit=limit)
        else:
            send = replay.waiting_for_each(rate)
            found = actions.backfill(op, entry, start, end, send=send, limit=limit)
    _report_backfill(entry, found.lock, found.plan, dry_run, as_json)


def _report_backfill(
    entry: str, lock: str, plan: list[dict[str, Any]], dry_run: bool, as_json: bool
) -> None:
    if as_json:
        output.echo_json({"entry": entry, "lock_name": lock, "dry_run": dry_run, "slots": plan})
        return
    sending = sum(1 for p in plan if p["action"] == "send")
    verb = "would send" if dry_run else "sent"
    click.echo(f"{entry} ({lock}): {verb} {sending} of {len(plan)} slots")
    rows = [(p["slot"], p["action"], p["why"], p.get("outcome")) for p in plan]
    click.echo(output.table(("SLOT", "ACTION", "WHY", "OUTCOME"), rows))


@click.command()
@click.argument("lock")
@click.argument("slot")
@click.option("--reason", required=True, help="Why this slot runs again (kept in the audit).")
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def rerun(
    ctx: click.Context, *, lock: str, slot: str, reason: str, by: str | None, as_json: bool
) -> None:
    """Run one succeeded slot of LOCK (a lock or a beat entry) once more, on purpose: a new
    attempt with a larger fencing token, and an audit row with the outcome it had."""
    if not reason.strip():
        raise Refused("--reason must say why the slot runs again")
    app = current_app(ctx)
    with reported_errors():
        op = operator_of(app, by, wait=True)
        result = actions.rerun(op, lock, slot, reason, send=replay.waiting_for_each())
    if as_json:
        output.echo_json(result)
        return
    previous = result["previous"]
    click.echo(
        f"{result['lock_name']} slot {slot}: ran again, {result['outcome']} with token "
        f"{result['token']} (before: token {previous['token']}, finished "
        f"{output.when(previous['finished_at'])})"
    )
