"""What every ``celery pglock`` command shares: exit codes and the errors that carry them,
``--json``, the app given to ``celery -A``, its lock names and a labelled connection.

Exit codes: 0 done; 1 not found (no such run, lock not held, no tables yet); 2 usage (bad
option or input, missing setting, refused without ``--yes``, name outside the app's
namespace, a misconfigured database: wrong credentials, unknown database or role, a
read-only server); 3 PostgreSQL unreachable (the message names the server, never the
password); 4 PostgreSQL refused (the role may not end other sessions).

Short commands fail at once when PostgreSQL is unreachable; the long-running ones
(``backfill``, ``resume --catch-up``, ``rerun``: they wait for workers anyway) first wait
for it as a worker does (``startup``), their WARNINGs on stderr.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from celery import Celery

from celery_pglock import ops, policy
from celery_pglock.config import app_settings, namespace_of
from celery_pglock.config import tables_of as config_tables
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    SchemaMissing,
    StatementFailed,
    WaitEnded,
)
from celery_pglock.failures import boundary
from celery_pglock.keys import lock_key
from celery_pglock.messages import BUILTIN_PREFIX
from celery_pglock.names import fixed_lock_name
from celery_pglock.schema import Tables
from celery_pglock.sessions import Connection, connect
from celery_pglock.startup import wait_for_postgres
from celery_pglock.task import PgLockMixin

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_FORBIDDEN = 4

F = TypeVar("F", bound=Callable[..., Any])

INSUFFICIENT_PRIVILEGE = "42501"  # SQLSTATE: e.g. may not end another role's session


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
    """Library errors (the driver's are translated where they are met: ``session``) as
    one clean line and an exit code; their messages never hold the password."""
    try:
        yield
    except SchemaMissing as exc:
        raise NotFound(str(exc)) from None
    except ConfigurationError as exc:
        raise Refused(str(exc)) from None
    except (DatabaseUnavailable, WaitEnded) as exc:  # WaitEnded: the server cut it short
        raise Unreachable(str(exc)) from None
    except StatementFailed as exc:
        if exc.sqlstate == INSUFFICIENT_PRIVILEGE:
            raise Forbidden(f"PostgreSQL refused: {exc}") from None
        raise NotFound(f"PostgreSQL error: {exc}") from None


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


def setup_django() -> None:
    """In a Django project, load its apps as ``celery worker`` and ``celery beat`` do (their
    Django fixup): a command line gets no such step, and django-celery-beat's models need it."""
    if not os.environ.get("DJANGO_SETTINGS_MODULE") or "django" not in sys.modules:
        return
    import django  # noqa: PLC0415 - only in a Django project
    from django.apps import apps  # noqa: PLC0415

    if not apps.ready:
        django.setup()


_loaded: weakref.WeakSet[Celery] = weakref.WeakSet()  # apps whose task modules were imported


def app_tasks(app: Celery) -> Mapping[str, Any]:
    """The app's tasks as its worker registers them: its task modules imported first
    (``imports``, ``include``, Django's autodiscovery), as ``celery worker`` and ``celery
    beat`` do at start-up; once per process."""
    if app not in _loaded:
        setup_django()
        app.loader.import_default_modules()
        _loaded.add(app)
    return app.tasks


def namespace(app: Celery) -> str:
    """The app-wide lock namespace (``pglock_namespace``, else the app's main name)."""
    return namespace_of(app.conf, app.main)


def task_lock_name(app: Celery, task_name: str) -> str | None:
    """The lock name of a registered locked task, when it does not depend on arguments."""
    task = app_tasks(app).get(task_name)
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
    for name, task in sorted(app_tasks(app).items()):
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
                row["locks"] = policy.describe(options)
                row["scope"] = options.scope
                row["scheduled_only"] = options.scheduled_only
        found.append(row)
    return found


def known_lock_names(app: Celery) -> dict[str, int]:
    """Lock names this app's tasks use, so their locks are named even before any run,
    each with its ``pglock_concurrency`` (how many keys it has)."""
    found: dict[str, int] = {}
    for task_name, task in list(app_tasks(app).items()):
        name = task_lock_name(app, task_name)
        if name and isinstance(task, PgLockMixin):
            found[name] = max(found.get(name, 1), task.pglock_options().concurrency)
    return dict(sorted(found.items()))


def resolve_lock(app: Celery, name: str) -> str:
    """A lock name, or a registered task name turned into its lock name."""
    try:
        lock_key(name)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None
    return task_lock_name(app, name) or name


def tables_of(app: Celery) -> Tables:
    """The app's tables from its settings, without needing a DSN."""
    return config_tables(app.conf)


@contextmanager
def session(app: Celery, *, wait: bool = False) -> Iterator[tuple[Connection, Tables]]:
    """A connection labelled with the operator (``pg_stat_activity``, server logs);
    ``wait``: waiting for PostgreSQL if it is away (long-running commands)."""
    settings = app_settings(app)
    label = f"celery-pglock cli {ops.operator()}".encode()[:63].decode("utf-8", "ignore")

    def attempt() -> Connection:
        return connect(settings, application_name=label)

    conn = (
        wait_for_postgres(settings, attempt, who=_command(), logger=stderr_logger())
        if wait
        else attempt()
    )
    with conn, boundary(settings, conn):
        yield conn, settings.tables


def _command() -> str:
    ctx = click.get_current_context(silent=True)
    return f"pglock {ctx.info_name}" if ctx is not None else "pglock"


def stderr_logger() -> logging.Logger:
    """Where a command's own log lines go: stderr, one line each (no logging is set up)."""
    logger = logging.getLogger("celery_pglock.cli")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # printed once, whatever the app configured
    return logger
