"""``celery-pglock``: the commands that need no Celery app (``demo``; ``run`` to come).

``celery -A proj pglock …`` is the operator's tool for an app; this one stands alone.
Subcommands import their implementation lazily, so ``celery-pglock --help`` stays fast
and a missing optional extra only breaks the subcommand that needs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

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


# `run NAME -- command…` (run a shell command under a lock) will be added here.


def main(argv: Sequence[str] | None = None) -> None:
    """Console-script entry point (``celery-pglock``)."""
    cli.main(args=list(argv) if argv is not None else None, prog_name="celery-pglock")
