"""What users name: the package's public names, the paths their configuration spells out,
and the commands with their options. A restructuring of the package keeps all of it."""

from __future__ import annotations

from importlib import metadata
from importlib.metadata import entry_points
from typing import Any

import click
from celery.beat import Scheduler
from kombu.utils.imports import symbol_by_name

import celery_pglock

PUBLIC_NAMES = [
    "SKIPPED",
    "WAITING",
    "ConfigurationError",
    "DatabaseError",
    "DatabaseUnavailable",
    "LockLost",
    "PgLockError",
    "PgLockMixin",
    "PgLockTask",
    "SchemaMissing",
    "StaleToken",
    "TaskSkipped",
    "__version__",
    "advisory_lock",
    "beat_leader_changed",
    "fence",
    "lock_acquired",
    "lock_key",
    "lock_lost",
    "migration_sql",
    "run_once",
    "task_overdue",
    "task_skipped",
]

# Dotted paths the README and docs tell users to write into their configuration.
CONFIGURED_PATHS = {
    "celery_pglock:PgLockTask": celery_pglock.PgLockTask,
    "celery_pglock.beat:PgLockScheduler": Scheduler,
    "celery_pglock.beat:PgLockSchedulerMixin": object,
}

# What ``pglock entries add`` and ``edit`` take alike: what an entry is made of.
ENTRY_OPTIONS = [
    "--args",
    "--at",
    "--by",
    "--catch-up",
    "--cron",
    "--enabled",
    "--every",
    "--exchange",
    "--expires",
    "--force",
    "--json",
    "--kwargs",
    "--overdue-after",
    "--priority",
    "--queue",
    "--routing-key",
    "--task",
    "--tz",
    "NAME",
]
COMMANDS = {
    "pglock entries add": ENTRY_OPTIONS,
    "pglock entries edit": ENTRY_OPTIONS,
    "pglock entries export": ["PATH"],
    "pglock entries import": ["--by", "--dry-run", "--force", "--from", "WHERE"],
    "pglock entries list": ["--json"],
    "pglock entries rm": ["--by", "--json", "NAME"],
    "pglock backfill": [
        "--by",
        "--dry-run",
        "--from",
        "--json",
        "--limit",
        "--rate",
        "--to",
        "ENTRY",
    ],
    "pglock migrate": ["--json", "--sql"],
    "pglock pause": ["--by", "--json", "--reason", "ENTRY"],
    "pglock prune": ["--any-namespace", "--batch", "--json", "--older-than"],
    "pglock release": ["--any-namespace", "--by", "--json", "--yes", "NAME"],
    "pglock rerun": ["--by", "--json", "--reason", "LOCK", "SLOT"],
    "pglock resume": ["--by", "--catch-up", "--json", "ENTRY"],
    "pglock runs": ["--json", "--limit", "--since", "--state", "--task"],
    "pglock schedule": ["--entry", "--from", "--json", "--next"],
    "pglock status": ["--json", "--skips", "LOCK"],
    "pglock trigger": ["--by", "--json", "--slot", "ENTRY"],
    "pglock web": ["--bind"],
    "pglock why": ["--json", "NAME", "SLOT"],
    "celery-pglock demo": ["ARGS"],
    "celery-pglock run": [
        "--dsn",
        "--lease",
        "--on-lost",
        "--schema",
        "--slot",
        "--table-prefix",
        "--timeout",
        "--wait",
        "COMMAND",
        "NAME",
    ],
}


def _commands(command: click.Command, prefix: str) -> dict[str, list[str]]:
    if isinstance(command, click.Group):
        found: dict[str, list[str]] = {}
        for name, sub in command.commands.items():
            found.update(_commands(sub, f"{prefix} {name}"))
        return found
    params: list[Any] = command.params
    names = [o for p in params for o in (p.opts if isinstance(p, click.Option) else [p.name])]
    return {prefix: sorted(n if n.startswith("-") else n.upper() for n in names)}


def test_the_public_names_are_the_documented_ones() -> None:
    assert sorted(PUBLIC_NAMES) == sorted(celery_pglock.__all__)
    assert all(hasattr(celery_pglock, name) for name in PUBLIC_NAMES)


def test_the_paths_users_configure_resolve() -> None:
    for path, kind in CONFIGURED_PATHS.items():
        found = symbol_by_name(path)
        assert isinstance(found, type)
        assert issubclass(found, kind), path


def test_the_entry_points_and_their_commands() -> None:
    """``celery pglock …`` (Celery's command plugin), ``celery beat -S pglock`` and the
    ``celery-pglock`` console script, with every subcommand and option."""
    (plugin,) = entry_points(group="celery.commands", name="pglock")
    (scheduler,) = entry_points(group="celery.beat_schedulers", name="pglock")
    (script,) = entry_points(group="console_scripts", name="celery-pglock")
    console = symbol_by_name(script.value.replace(":main", ":cli"))

    assert issubclass(scheduler.load(), Scheduler)
    assert callable(script.load())
    assert COMMANDS == {**_commands(plugin.load(), "pglock"), **_commands(console, script.name)}


def test_the_testing_tools_for_users_suites() -> None:
    """``celery_pglock.testing`` (docs/testing.md) and its pytest plugin's fixtures."""
    from celery_pglock import testing  # noqa: PLC0415

    (plugin,) = entry_points(group="pytest11", name="celery_pglock")
    fixtures = {name for name in vars(plugin.load()) if name.startswith("pglock_")}

    assert ["PgLockDatabase", "assert_skipped", "deliver_twice", "fresh_database"] == sorted(
        testing.__all__
    )
    assert {"pglock_database", "pglock_postgres"} == fixtures


def test_the_version_has_one_place() -> None:
    """``celery_pglock.__version__`` is what the installed distribution says (pyproject.toml
    reads it from the package: no second copy to forget)."""
    assert metadata.version("celery-pglock") == celery_pglock.__version__
