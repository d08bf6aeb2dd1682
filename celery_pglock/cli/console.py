"""``celery-pglock``: the commands that need no Celery app (``demo``, ``run``).

``celery -A proj pglock …`` is the operator's tool for an app; this one stands alone.
Subcommands import their implementation lazily, so ``celery-pglock --help`` stays fast
and a missing optional extra only breaks the subcommand that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Literal

import click

DEMO_MODULE = "celery_pglock.demo"
DEMO_HINT = "pip install 'celery-pglock[demo]'"


@click.group(name="celery-pglock", context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="celery-pglock")
def cli() -> None:
    """Run Celery periodic tasks once across replicas, with PostgreSQL advisory locks."""


@cli.command(
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def demo(args: tuple[str, ...]) -> None:
    """The problem and the cure, live: `celery-pglock demo --help` for its options."""
    try:
        module = importlib.import_module(DEMO_MODULE)
    except ImportError as exc:
        raise click.ClickException(f"the demo is not available ({exc}); {DEMO_HINT}") from None
    raise click.exceptions.Exit(int(module.main(list(args)) or 0))


@cli.command(context_settings={"show_default": True})
@click.argument("name")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--slot", help="Run this slot once: skipped once it succeeded (e.g. a date).")
@click.option(
    "--dsn",
    help="PostgreSQL URL [default: $PGLOCK_DSN, else $DATABASE_URL]. Prefer the environment: "
    "other users can read a password given here (ps).",
)
@click.option("--schema", default="public", help="Schema of the celery-pglock tables.")
@click.option("--table-prefix", default="pglock_", help="Prefix of the table names.")
@click.option(
    "--lease", type=float, default=30.0, help="Seconds a frozen holder keeps the lock; 0: no lease."
)
@click.option("--wait", is_flag=True, help="Wait for the lock instead of skipping.")
@click.option("--timeout", type=float, help="With --wait: give up (skip) after this many seconds.")
@click.option(
    "--on-lost",
    type=click.Choice(["terminate", "continue"]),
    default="terminate",
    help="What to do with the command when the lock is lost.",
)
def run(  # click passes every parameter by keyword
    *,
    name: str,
    command: tuple[str, ...],
    slot: str | None,
    dsn: str | None,
    schema: str,
    table_prefix: str,
    lease: float,
    wait: bool,
    timeout: float | None,
    on_lost: Literal["terminate", "continue"],
) -> None:
    """Run COMMAND under lock NAME, once per --slot: `celery-pglock run NAME -- command args…`.

    Skipped (exit 0, one line on stderr saying why and who holds the lock) when another
    process holds NAME or the slot already succeeded; otherwise exits with the command's
    status (125: celery-pglock failed, 126/127: the command cannot run). The command gets
    PGLOCK_LOCK, PGLOCK_SLOT and PGLOCK_TOKEN; SIGTERM, SIGINT and SIGHUP are forwarded.
    """
    from celery_pglock._standalone import LockOptions  # noqa: PLC0415
    from celery_pglock.cli._run import EXIT_WRAPPER_FAILED, run_command  # noqa: PLC0415
    from celery_pglock.errors import ConfigurationError  # noqa: PLC0415

    try:
        options = LockOptions(dsn, "session", lease, wait, timeout, schema, table_prefix)
    except ConfigurationError as exc:
        click.echo(f"celery-pglock run: error: {exc}", err=True)
        raise click.exceptions.Exit(EXIT_WRAPPER_FAILED) from None
    raise click.exceptions.Exit(run_command(name, command, options, slot, on_lost))


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``celery-pglock``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="celery-pglock")
