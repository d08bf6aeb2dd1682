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
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import click
from celery import Celery

from celery_pglock import ops
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    SchemaMissing,
    StatementFailed,
    WaitEnded,
)
from celery_pglock.steering._apps import lock_of
from celery_pglock.steering._operator import Operator
from celery_pglock.steering.actions import NothingToDo
from celery_pglock.store.statements import Statements

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
    """Library errors (the driver's are translated where they are met: ``connection``) as
    one clean line and an exit code; their messages never hold the password."""
    try:
        yield
    except (SchemaMissing, NothingToDo) as exc:
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


def resolve_lock(app: Celery, name: str) -> str:
    """A lock name, or a registered task name turned into its lock name."""
    try:
        return lock_of(app, name)
    except ConfigurationError as exc:
        raise click.BadParameter(str(exc), param_hint="NAME") from None


@contextmanager
def connection(app: Celery, *, wait: bool = False) -> Iterator[Statements]:
    """Statements on a connection labelled with the operator (``pg_stat_activity``,
    server logs); ``wait``: waiting for PostgreSQL if it is away (long-running commands)."""
    with operator_of(app, None, wait=wait).connection() as opened:
        yield opened


def operator_of(app: Celery, by: str | None, *, wait: bool = False) -> Operator:
    """The operator acting from this command line (``--by``, default ``user@host``), whose
    connections are labelled as the command's; ``wait``: waiting for PostgreSQL if away."""
    return Operator(
        app,
        by or ops.operator(),
        f"celery-pglock cli {ops.operator()}",
        wait=wait,
        who=_command(),
        logger=stderr_logger(),
    )


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
