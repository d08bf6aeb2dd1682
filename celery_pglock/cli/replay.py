"""``celery -A proj pglock schedule|backfill|rerun``: the slots to come, and slots run again.

``schedule`` shows what every beat replica will send; ``backfill`` sends an entry's past
slots that never succeeded (the ledger says which), oldest first, at a bounded rate;
``rerun`` runs one succeeded slot once more, on purpose, with its audit row.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import click

from celery_pglock import controls, preview
from celery_pglock.beat.settings import BeatSettings
from celery_pglock.cli import output
from celery_pglock.cli.common import (
    NotFound,
    Refused,
    current_app,
    json_option,
    reported_errors,
    session,
)
from celery_pglock.cli.entries import BY_HELP
from celery_pglock.steering import replay
from celery_pglock.steering.apps import Schedule, target

BACKFILL_LIMIT = 100  # slots per backfill unless --limit says more
DAY = timedelta(days=1)


def moment(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    """An ISO-8601 time with its UTC offset (``Z`` or ``+02:00``); a date means its start."""
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not an ISO-8601 time") from None
    if parsed.tzinfo is None:
        raise click.BadParameter(f"{value!r} has no UTC offset: add Z or +HH:MM")
    return parsed.astimezone(timezone.utc)


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
    with reported_errors():
        entries = Schedule(app)
        found = entries.entry(entry)
        wanted = replay.slots_between(app, found, start, end, limit)
        if not wanted:
            raise NotFound(f"{entry} has no slot in that range (see `pglock schedule --from`)")
        lock = entries.lock_name(found)
        with session(app, wait=not dry_run) as (conn, tables):
            plan = replay.plan(controls.slot_rows(conn, tables, lock, wanted), wanted)
            if not dry_run:  # audited first: a backfill stopped half-way leaves its trail
                controls.audit(
                    conn,
                    target(app, by),
                    "backfill",
                    entry=entry,
                    lock_name=lock,
                    range=[start, end],
                    sent=[p["slot"] for p in plan if p["action"] == "send"],
                )
                delivery = replay.Delivery(app, conn, tables, found, lock)
                replay.send_plan(plan, delivery, rate)
    _report_backfill(entry, lock, plan, dry_run, as_json)


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
        entries = Schedule(app)
        entry, lock_name = replay.entry_of(entries, lock)
        with session(app, wait=True) as (conn, tables):
            previous = controls.reopen(
                conn, target(app, by), lock_name=lock_name, slot=slot, reason=reason
            )
            if previous is None:
                raise NotFound(
                    f"slot {slot} of {lock_name} has not succeeded: nothing to run again "
                    "(send it with `pglock trigger --slot` or `pglock backfill`)"
                )
            outcome = replay.Delivery(app, conn, tables, entry, lock_name).run(slot)
            row = controls.run_row(conn, tables, lock_name, slot)
    result: dict[str, Any] = {"lock_name": lock_name, "slot": slot, "previous": previous}
    result["outcome"] = outcome
    result["token"] = row["token"] if row else None
    if as_json:
        output.echo_json(result)
        return
    click.echo(
        f"{lock_name} slot {slot}: ran again, {outcome} with token {result['token']} "
        f"(before: token {previous['token']}, finished {output.when(previous['finished_at'])})"
    )
