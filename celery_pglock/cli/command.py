"""``celery -A proj pglock …``: the operator's commands.

``status``, ``runs``, ``migrate``, ``prune`` and ``release`` are here; ``pause``,
``resume``, ``trigger`` and ``why`` in ``cli/_controls.py``; ``schedule``, ``backfill`` and
``rerun`` in ``cli/_replay.py``; ``entries`` in ``cli/_schedule_entries.py``. Registered on
``celery`` through the ``celery.commands`` entry point; the app comes from ``-A``. Every
command prints an aligned table by default and JSON with ``--json``, and exits with a code
that means something (``cli/_common.py``).
"""

from __future__ import annotations

from datetime import datetime, timedelta

import click
from celery import Celery

from celery_pglock import ops, retention
from celery_pglock._config import app_settings, tables_of
from celery_pglock._keys import lock_key
from celery_pglock.cli import _output as output
from celery_pglock.cli._common import (
    EXIT_NOT_FOUND,
    NotFound,
    Refused,
    connection,
    current_app,
    json_option,
    operator_of,
    reported_errors,
    resolve_lock,
)
from celery_pglock.cli._controls import pause, resume, trigger, why
from celery_pglock.cli._entries import BY_HELP
from celery_pglock.cli._replay import backfill, rerun, schedule
from celery_pglock.cli._schedule_entries import entries
from celery_pglock.cli._web import web
from celery_pglock.errors import ConfigurationError
from celery_pglock.steering import _reads as reads
from celery_pglock.steering import actions
from celery_pglock.steering._apps import namespace
from celery_pglock.store.statements import Statements

# -- commands -----------------------------------------------------------------------------


@click.group(name="pglock")
def pglock() -> None:
    """celery-pglock: held locks, beat leader, run history, schema and retention."""


@pglock.command()
@click.argument("lock", required=False)
@click.option("--skips", default=10, show_default=True, type=click.IntRange(min=0))
@json_option
@click.pass_context
def status(ctx: click.Context, lock: str | None, skips: int, as_json: bool) -> None:
    """Held locks, beat leader and standbys, running runs, recent skips.

    With LOCK (a lock or task name), only that lock; exit 1 if nobody holds it.
    """
    app = current_app(ctx)
    with reported_errors(), connection(app) as statements:
        if lock is not None:
            _one_lock_status(statements, resolve_lock(app, lock), as_json)
            return
        view = reads.status(app, statements, skips=skips)
    if view.note:
        click.echo(view.note, err=True)
    if as_json:
        output.echo_json(view.as_json())
        return
    found, fresh = view.found, view.fresh
    where = statements.tables.table("*").as_string()
    click.echo(f"celery-pglock: namespace {found.namespace!r}, tables {where}")
    click.echo("session-scope locks and beat's leader on {} ({})\n".format(*view.lock_backend))
    parts = [output.freshness_text(fresh)] if fresh else []  # overdue entries first
    parts += [output.rogue_text(found.rogue)] if found.rogue else []
    parts += [output.shadowed_text(view.shadowed)] if view.shadowed else []
    parts += [output.locks_text(found.locks)]
    parts += [output.waiting_text(found.waiting)] if found.waiting else []
    parts += [output.beat_text(found.beat)]
    parts += [output.pauses_text(view.paused)] if view.paused else []
    parts += [output.running_text(found.running), output.skips_text(found.skips)]
    parts += [output.tasks_text(view.tasks)]
    click.echo("\n\n".join(parts))


def _one_lock_status(statements: Statements, name: str, as_json: bool) -> None:
    ops.require_tables(statements)
    key = lock_key(name)
    found = [entry for entry in ops.locks(statements, [name]) if entry["key"] == key]
    entry = found[0] if found else {"lock": name, "key": key, "holder": None, "waiters": []}
    entry["lock"] = name
    if as_json:
        output.echo_json(entry)
    else:
        click.echo(output.locks_text([entry]) if entry["holder"] else f"{name}: not held")
    if entry["holder"] is None:
        raise click.exceptions.Exit(EXIT_NOT_FOUND)


def _since(ctx: click.Context, param: click.Parameter, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        return retention.parse_since(value)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc)) from None


@pglock.command()
@click.option("--task", help="Task or lock name; * matches anything.")
@click.option("--since", callback=_since, help="Updated since: 2h, 7d, or an ISO-8601 time.")
@click.option("--state", type=click.Choice(ops.RUN_STATES))
@click.option("--limit", default=50, show_default=True, type=click.IntRange(min=1))
@json_option
@click.pass_context
def runs(
    ctx: click.Context,
    *,
    task: str | None,
    since: datetime | None,
    state: str | None,
    limit: int,
    as_json: bool,
) -> None:
    """Run history from the ledger, newest first; exit 1 if nothing matches."""
    app = current_app(ctx)
    with reported_errors(), connection(app) as statements:
        found = ops.runs(statements, task=task, since=since, state=state, limit=limit)
    if as_json:
        output.echo_json(found)
    elif found:
        click.echo(output.runs_text(found))
    else:
        click.echo("no runs match", err=True)
    if not found:
        raise click.exceptions.Exit(EXIT_NOT_FOUND)


@pglock.command()
@click.option("--sql", "print_sql", is_flag=True, help="Print the SQL for a DBA; no database.")
@json_option
@click.pass_context
def migrate(ctx: click.Context, print_sql: bool, as_json: bool) -> None:
    """Create or upgrade the tables (or print the SQL that would)."""
    app = current_app(ctx)
    if print_sql:
        with reported_errors():
            click.echo(tables_of(app.conf).full_schema_sql(), nl=False)
        return
    with reported_errors():
        done = ops.migrate(app_settings(app))
    if as_json:
        output.echo_json(done.as_json())
    elif done.applied:
        applied = ", ".join(map(str, done.applied))
        click.echo(f"applied migration {applied}: {done.schema!r} is at version {done.version}")
    else:
        click.echo(f"schema {done.schema!r} already at version {done.version}")


@pglock.command()
@click.option("--older-than", help="Age to delete: 7d, 12h… [pglock_ledger_retention]")
@click.option("--batch", default=retention.BATCH, show_default=True, type=click.IntRange(min=1))
@click.option("--any-namespace", is_flag=True, help="Also other apps' rows in these tables.")
@json_option
@click.pass_context
def prune(
    ctx: click.Context, older_than: str | None, batch: int, any_namespace: bool, as_json: bool
) -> None:
    """Delete this app's old runs, skips, beat send claims and holder rows, in batches."""
    app = current_app(ctx)
    scope = None if any_namespace else namespace(app)
    with reported_errors():
        age = _retention(app, older_than)
        with connection(app) as statements:
            ops.require_tables(statements)
            done = retention.prune(statements, age, batch=batch, namespace=scope)
    if as_json:
        output.echo_json(done.as_json())
        return
    counts = ", ".join(f"{table} {count}" for table, count in done.deleted.items())
    click.echo(f"deleted rows untouched for {output.duration(age.total_seconds())}: {counts}")


def _retention(app: Celery, older_than: str | None) -> timedelta:
    if older_than is not None:
        return retention.check_retention(retention.parse_duration(older_than, "--older-than"))
    age = retention.retention_setting(app.conf)
    if age is None:
        raise Refused("give --older-than (e.g. 7d) or set pglock_ledger_retention")
    return age


@pglock.command()
@click.argument("name")
@click.option("--yes", is_flag=True, help="Really end the holder's session.")
@click.option("--any-namespace", is_flag=True, help="Allow a lock outside this app's namespace.")
@click.option("--by", help=BY_HELP)
@json_option
@click.pass_context
def release(
    ctx: click.Context, *, name: str, yes: bool, any_namespace: bool, by: str | None, as_json: bool
) -> None:
    """End the session holding lock NAME (a lock or task name); needs --yes.

    PostgreSQL frees the lock at once; the holder learns it on its next heartbeat and
    reports the lock as lost. Who did it is logged and audited, as from the dashboard.
    """
    app = current_app(ctx)
    op = operator_of(app, by)
    with reported_errors():
        name = actions.lock_to_release(op, name, any_namespace=any_namespace)
        with op.connection() as statements:
            found = ops.holders(statements, name)
        if not found:
            raise NotFound(f"lock {name!r} is not held")
        if not yes:
            click.echo(output.holders_text(name, found), err=True)
            click.echo(output.shared_note(found), err=True, nl=False)
            raise Refused("refusing to end this session without --yes")
        done = actions.release(op, name, any_namespace=any_namespace)
    _report_release(name, done, as_json)


def _report_release(name: str, done: ops.ForcedRelease, as_json: bool) -> None:
    if as_json:
        output.echo_json(done.as_json())
    else:
        click.echo(output.holders_text(name, done.terminated))
        click.echo(output.shared_note(done.terminated), nl=False)
        state = "free" if done.released else "still held 5 s after termination"
        click.echo(f"\nterminated by {done.operator}; lock {name!r} is {state}")
    if not done.released:
        raise click.exceptions.Exit(EXIT_NOT_FOUND)


for command in (pause, resume, trigger, why, schedule, backfill, rerun, web, entries):
    pglock.add_command(command)
