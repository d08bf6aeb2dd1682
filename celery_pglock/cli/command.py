"""``celery -A proj pglock status|runs|migrate|prune|release``: the operator's commands
(``pause``, ``resume``, ``trigger`` and ``why`` are in ``cli/controls.py``).

Registered on ``celery`` through the ``celery.commands`` entry point; the app comes from
``-A``. Every command prints an aligned table by default and JSON with ``--json``, and
exits with a code that means something:

- 0: done;
- 1: not found (no such run, lock not held, no tables yet);
- 2: usage (bad option, missing setting, refused without ``--yes``, name outside the
  app's namespace);
- 3: PostgreSQL unreachable (the message names the server, never the password);
- 4: PostgreSQL refused (the role may not end other sessions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, TypeVar

import click
import psycopg
from celery import Celery

from celery_pglock import controls, keys, ops, retention
from celery_pglock.cli import output
from celery_pglock.config import APP_DEFAULTS, app_settings, redact
from celery_pglock.db import Connection, connect
from celery_pglock.errors import ConfigurationError, DatabaseUnavailable, SchemaMissing
from celery_pglock.keys import lock_key
from celery_pglock.messages import BUILTIN_PREFIX
from celery_pglock.names import fixed_lock_name
from celery_pglock.schema import Tables
from celery_pglock.task import PgLockMixin

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_FORBIDDEN = 4

F = TypeVar("F", bound=Callable[..., Any])


class NotFound(click.ClickException):
    """Nothing to show or act on: no such run, lock not held, no tables yet."""

    exit_code = EXIT_NOT_FOUND


class Refused(click.ClickException):
    """The command line asks for something we will not do as given."""

    exit_code = EXIT_USAGE


class Unreachable(click.ClickException):
    """PostgreSQL could not be reached (or the connection broke)."""

    exit_code = EXIT_UNREACHABLE


class Forbidden(click.ClickException):
    """PostgreSQL refused the operation to this role."""

    exit_code = EXIT_FORBIDDEN


@contextmanager
def reported_errors() -> Iterator[None]:
    """Library and driver errors as one clean line and an exit code (passwords redacted)."""
    try:
        yield
    except SchemaMissing as exc:
        raise NotFound(str(exc)) from None
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None
    except DatabaseUnavailable as exc:
        raise Unreachable(str(exc)) from None
    except psycopg.errors.InsufficientPrivilege as exc:
        raise Forbidden(f"PostgreSQL refused: {_first_line(exc)}") from None
    except psycopg.OperationalError as exc:
        message = f"lost the connection to PostgreSQL: {_first_line(exc)}"
        raise Unreachable(message) from None
    except psycopg.Error as exc:
        raise NotFound(f"PostgreSQL error: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return redact(text.splitlines()[0] if text else type(exc).__name__)


def json_option(function: F) -> F:
    return click.option(
        "--json", "as_json", is_flag=True, help="Print JSON for scripts instead of a table."
    )(function)


# -- the app ------------------------------------------------------------------------------


def current_app(ctx: click.Context) -> Celery:
    """The app given to ``celery -A``."""
    obj = ctx.find_root().obj
    app = getattr(obj, "app", None)
    if app is None:
        raise Refused("no Celery app: run as `celery -A proj pglock …`")
    return app  # type: ignore[no-any-return]


def namespace(app: Celery) -> str:
    """The app-wide lock namespace (``pglock_namespace``, else the app's main name)."""
    return keys.namespace(app.conf.get("pglock_namespace"), app.main)


def task_lock_name(app: Celery, task_name: str) -> str | None:
    """The lock name of a registered locked task, when it does not depend on arguments."""
    task = app.tasks.get(task_name)
    if not isinstance(task, PgLockMixin):
        return None
    try:
        options = task.pglock_options()
    except ConfigurationError:
        return None
    return fixed_lock_name(task_name, options)


def registered_tasks(app: Celery) -> list[dict[str, Any]]:
    """The app's tasks (not Celery's own): locked or not, and how, for ``status``."""
    found = []
    for name, task in sorted(app.tasks.items()):
        if name.startswith(BUILTIN_PREFIX):
            continue
        row: dict[str, Any] = {"task": name, "locked": isinstance(task, PgLockMixin)}
        if isinstance(task, PgLockMixin):
            try:
                options = task.pglock_options()
            except ConfigurationError as exc:
                row["error"] = str(exc)
            else:
                row["lock"] = task_lock_name(app, name) or "(from the arguments)"
                row["scope"] = options.scope
                row["scheduled_only"] = options.scheduled_only
        found.append(row)
    return found


def known_lock_names(app: Celery) -> list[str]:
    """Lock names this app's tasks use, so their locks are named even before any run."""
    names = (task_lock_name(app, name) for name in list(app.tasks))
    return sorted({name for name in names if name})


def resolve_lock(app: Celery, name: str) -> str:
    """A lock name, or a registered task name turned into its lock name."""
    try:
        lock_key(name)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    return task_lock_name(app, name) or name


def tables_of(app: Celery) -> Tables:
    """The app's tables from its settings, without needing a DSN."""
    conf = app.conf
    schema = conf.get("pglock_schema") or APP_DEFAULTS["pglock_schema"]
    prefix = conf.get("pglock_table_prefix")
    return Tables(schema, APP_DEFAULTS["pglock_table_prefix"] if prefix is None else prefix)


@contextmanager
def session(app: Celery) -> Iterator[tuple[Connection, Tables]]:
    """A connection labelled with the operator (``pg_stat_activity``, server logs)."""
    settings = app_settings(app)
    label = f"celery-pglock cli {ops.operator()}".encode()[:63].decode("utf-8", "ignore")
    with connect(settings, application_name=label) as conn:
        yield conn, settings.tables


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
    with reported_errors(), session(app) as (conn, tables):
        if lock is not None:
            _one_lock_status(conn, tables, app, resolve_lock(app, lock), as_json)
            return
        found = ops.status(
            conn, tables, namespace=namespace(app), known_names=known_lock_names(app), skips=skips
        )
        paused = controls.pauses(conn, controls.Target(tables, found.namespace, ops.operator()))
    tasks = registered_tasks(app)
    if as_json:
        output.echo_json({**found.as_json(), "paused": paused, "tasks": tasks})
        return
    where = tables.table("*").as_string()
    click.echo(f"celery-pglock: namespace {found.namespace!r}, tables {where}\n")
    parts = [output.locks_text(found.locks), output.beat_text(found.beat)]
    parts += [output.pauses_text(paused)] if paused else []
    parts += [output.running_text(found.running), output.skips_text(found.skips)]
    parts += [output.tasks_text(tasks)]
    click.echo("\n\n".join(parts))


def _one_lock_status(
    conn: Connection, tables: Tables, app: Celery, name: str, as_json: bool
) -> None:
    ops.require_tables(conn, tables)
    key = lock_key(name)
    found = [entry for entry in ops.locks(conn, tables, [name]) if entry["key"] == key]
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
    with reported_errors(), session(app) as (conn, tables):
        found = ops.runs(conn, tables, task=task, since=since, state=state, limit=limit)
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
            click.echo(tables_of(app).full_schema_sql(), nl=False)
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
        with session(app) as (conn, tables):
            ops.require_tables(conn, tables)
            done = retention.prune(conn, tables, age, batch=batch, namespace=scope)
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
@json_option
@click.pass_context
def release(ctx: click.Context, name: str, yes: bool, any_namespace: bool, as_json: bool) -> None:
    """End the session holding lock NAME (a lock or task name); needs --yes.

    PostgreSQL frees the lock at once; the holder learns it on its next heartbeat and
    reports the lock as lost. Who did it is logged.
    """
    app = current_app(ctx)
    name = resolve_lock(app, name)
    prefix = f"{namespace(app)}:"
    if not name.startswith(prefix) and not any_namespace:
        message = f"{name!r} is outside this app's namespace {prefix!r}; add --any-namespace"
        raise Refused(message)
    with reported_errors(), session(app) as (conn, tables):
        found = ops.holders(conn, tables, name)
        if not found:
            raise NotFound(f"lock {name!r} is not held")
        if not yes:
            click.echo(output.holders_text(name, found), err=True)
            raise Refused("refusing to end this session without --yes")
        done = ops.force_release(conn, tables, name)
    _report_release(name, done, as_json)


def _report_release(name: str, done: ops.ForcedRelease | None, as_json: bool) -> None:
    if done is None or not done.terminated:
        raise NotFound(f"lock {name!r} was freed before it could be released")
    if as_json:
        output.echo_json(done.as_json())
    else:
        click.echo(output.holders_text(name, done.terminated))
        state = "free" if done.released else "still held 5 s after termination"
        click.echo(f"\nterminated by {done.operator}; lock {name!r} is {state}")
    if not done.released:
        raise click.exceptions.Exit(EXIT_NOT_FOUND)


# The operator controls register their commands on `pglock`: pause, resume, trigger, why
# (controls), schedule, backfill, rerun (replay).
from celery_pglock.cli import controls as _controls  # noqa: E402, F401
from celery_pglock.cli import replay as _replay  # noqa: E402, F401
