"""``celery -A proj pglock …`` against a real PostgreSQL, with locks held by real processes.

Most tests drive the click group in-process (``CliRunner``, with the ``CLIContext`` that
``celery -A`` builds); the last ones run the real ``celery`` and ``celery-pglock``
command lines to prove the entry points and exit codes end to end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from psycopg import sql

from celery_pglock import PgLockTask
from celery_pglock import _controls as controls
from celery_pglock import _waiting as waiting
from celery_pglock._config import Settings
from celery_pglock._ledger import FAILED, SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.cli.command import pglock
from celery_pglock.cli.console import cli as console_cli
from celery_pglock.schema import latest_version
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import Database
from celery_pglock.store.statements import OnConnection
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.fixtures.procs import Procs, wait_until
from tests.integration.locking import Conn, claim, granted, lock_holders, open_database
from tests.integration.test_ops import SLOT, start_holder

pytestmark = pytest.mark.integration

PASSWORD = "Sup3rS3cretPw"  # noqa: S105 - fake; must never be printed
UNREACHABLE_DSN = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"
TASK = "cli.job"

STATUS_KEYS = {"namespace", "schema", "table_prefix", "locks", "beat", "running", "skips"}
STATUS_KEYS |= {"rogue_sends"}
STATUS_KEYS |= {"freshness", "paused", "tasks", "waiting", "entries_shadowed"}
STATUS_KEYS |= {"lock_backend", "lock_backend_why"}
LOCK_KEYS = {"lock", "key", "holder", "waiters", "concurrency", "held"}
HOLDER_KEYS = {"host", "pid", "task_id", "scope", "slot", "token", "since", "backend_pid"}
HOLDER_KEYS |= {"application_name", "client_addr", "user", "lock_backend"}
RUN_KEYS = {"lock_name", "slot", "state", "attempts", "token", "task_name", "task_id", "host"}
RUN_KEYS |= {"pid", "started_at", "finished_at", "duration_seconds", "skips", "skip_reasons"}


def make_app(dsn: str, schema: str, **conf: Any) -> Celery:
    """An app like a user's: one locked task, namespace = the test's schema."""
    app = Celery("cliapp", set_as_current=False)
    app.conf.update(pglock_dsn=dsn, pglock_schema=schema, pglock_namespace=schema, **conf)

    @app.task(base=PgLockTask, name=TASK, shared=False)
    def job() -> None:
        """Never run here: only its lock name matters."""

    return app


def invoke(app: Celery, *args: str) -> Result:
    """``celery -A app pglock *args``, in-process."""
    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(pglock, list(args), obj=obj)


@pytest.fixture
def app(pg_dsn: str, pglock_schema: str) -> Celery:
    return make_app(pg_dsn, pglock_schema)


@pytest.fixture
def db(pg_dsn: str, pglock_schema: str) -> Iterator[Database]:
    with open_database(Settings(dsn=pg_dsn, schema=pglock_schema)) as database:
        yield database


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[Conn]:
    with psycopg.connect(pg_dsn, autocommit=True) as connection:
        yield connection


def task_lock(schema: str) -> str:
    return f"{schema}:{TASK}"


# -- migrate -----------------------------------------------------------------------------


def test_migrate_sql_prints_the_schema_without_a_database(pglock_schema: str) -> None:
    """migrate --sql prints the DDL for a DBA, even with PostgreSQL unreachable."""
    result = invoke(make_app(UNREACHABLE_DSN, pglock_schema), "migrate", "--sql")

    assert 0 == result.exit_code, result.output
    assert f'CREATE TABLE IF NOT EXISTS "{pglock_schema}"."pglock_runs"' in result.stdout
    assert PASSWORD not in result.output


def test_migrate_applies_then_reports_up_to_date(app: Celery, pglock_schema: str) -> None:
    """migrate creates the tables once; a second run applies nothing (JSON for scripts)."""
    first = invoke(app, "migrate", "--json")
    second = invoke(app, "migrate", "--json")

    assert (0, 0) == (first.exit_code, second.exit_code), first.output + second.output
    latest = latest_version()
    assert {"applied": list(range(1, latest + 1)), "version": latest, "schema": pglock_schema} == {
        key: json.loads(first.stdout)[key] for key in ("applied", "version", "schema")
    }
    assert [] == json.loads(second.stdout)["applied"]


# -- status ------------------------------------------------------------------------------


def test_status_json_describes_holder_running_row_and_skips(
    app: Celery, db: Database, procs: Procs, pglock_schema: str
) -> None:
    """status --json: the task's lock with its holder, the running row, the skip log."""
    name = task_lock(pglock_schema)
    holder = start_holder(procs, db.settings.dsn, pglock_schema, name, slot=SLOT, task_id="t-1")
    acquire(db, claim(name, SLOT, "t-dup"), "session", None)  # a duplicate: skipped

    result = invoke(app, "status", "--json")

    assert 0 == result.exit_code, result.output
    payload = json.loads(result.stdout)
    assert STATUS_KEYS == set(payload)
    [lock] = [entry for entry in payload["locks"] if entry["lock"] == name]
    assert LOCK_KEYS == set(lock)
    assert HOLDER_KEYS == set(lock["holder"])
    assert (HOSTNAME, holder.proc.pid, "t-1", SLOT, holder.token) == tuple(
        lock["holder"][key] for key in ("host", "pid", "task_id", "slot", "token")
    )
    assert [(name, SLOT, True)] == [
        (run["lock_name"], run["slot"], run["holder_alive"]) for run in payload["running"]
    ]
    assert [("locked", "t-dup", "t-1")] == [
        (skip["reason"], skip["task_id"], skip["holder_task_id"]) for skip in payload["skips"]
    ]
    assert {"lock", "key", "leader", "standbys"} == set(payload["beat"])
    assert ("advisory", "no transaction pooler between this process and PostgreSQL") == (
        payload["lock_backend"],
        payload["lock_backend_why"],
    )


OPERATIONS = Path(__file__).parents[2] / "docs" / "operations.md"
# Fields not always there: a task's when its options are invalid; a waiter's.
OPTIONAL = {"task": {"error"}, "session": {"waiting_since", "expires_at"}}


def documented_fields() -> dict[str, set[str]]:
    """docs/operations.md's "JSON output": each object's table of fields, by its name."""
    text = OPERATIONS.read_text().split("### JSON output", 1)[1].split("\n### ", 1)[0]
    found: dict[str, set[str]] = {}
    name = ""
    for line in text.splitlines():
        if line.startswith("**"):
            name = line.split("**")[1].strip("`").removesuffix(" --json")
        elif line.startswith("| `"):
            found.setdefault(name, set()).add(line.split("`")[1])
    return found


def test_every_field_of_status_and_runs_json_is_documented_once(
    db: Database, procs: Procs, pg_dsn: str, pglock_schema: str
) -> None:
    """status --json and runs --json, with something in every section (a holder and its
    running row, a skip, a waiting slot, a pause, a rogue send, a watched entry), print
    exactly the fields docs/operations.md describes."""
    app = make_app(
        pg_dsn,
        pglock_schema,
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
        beat_schedule={
            "nightly": {"task": TASK, "schedule": 60.0, "options": {"pglock_overdue_after": 600}}
        },
    )
    name = task_lock(pglock_schema)
    start_holder(procs, db.settings.dsn, pglock_schema, name, slot=SLOT, task_id="t-1")
    acquire(db, claim(name, SLOT, "t-dup"), "session", None)
    waiter = dataclasses.replace(claim(name, "2026-11-29T18:06:00Z", "t-2"), buffer=True)
    waiting.decide(db, waiter, waiting.Message(TASK, [], {}, "json", "celery", "celery"))
    target = controls.Target(db.tables, pglock_schema, "alice")
    with db.connection() as conn:
        controls.pause(OnConnection(conn, db.tables), target, "nightly", "ticket 1")
        params = {"namespace": pglock_schema, "task_name": TASK, "origin": "gen1@host"}
        conn.execute(db.tables.query("record_rogue_send"), params)

    status = json.loads(invoke(app, "status", "--json").stdout)
    [run] = json.loads(invoke(app, "runs", "--json").stdout)[:1]
    [lock] = [entry for entry in status["locks"] if entry["lock"] == name]
    printed = {
        "status": set(status),
        "lock": set(lock),
        "session": set(lock["holder"]),
        "beat": set(status["beat"]),
        "run": set(run),
        **{
            kind: set(status[section][0])
            for kind, section in (
                ("running", "running"),
                ("skip", "skips"),
                ("waiting", "waiting"),
                ("freshness", "freshness"),
                ("pause", "paused"),
                ("rogue send", "rogue_sends"),
                ("task", "tasks"),
            )
        },
    }

    documented = documented_fields()
    assert set(printed) == set(documented)
    assert {kind: documented[kind] - OPTIONAL.get(kind, set()) for kind in printed} == printed


def test_status_table_shows_lock_host_task_and_health(
    app: Celery, db: Database, procs: Procs, pglock_schema: str
) -> None:
    """The human table names the lock, the holder's host and task id, and its health."""
    name = task_lock(pglock_schema)
    start_holder(procs, db.settings.dsn, pglock_schema, name, slot=SLOT, task_id="t-table")

    result = invoke(app, "status")

    assert 0 == result.exit_code, result.output
    held_section = result.stdout.split("\n\n")[1]  # after the header line
    [row] = [line for line in held_section.splitlines() if line.startswith(f"{name} ")]
    assert {"session", HOSTNAME, "t-table", SLOT} <= set(row.split())
    assert "alive" in result.stdout
    assert "BEAT" in result.stdout


def test_status_lists_which_registered_tasks_are_locked(app: Celery, pglock_schema: str) -> None:
    """status names every task of the app, locked or not (Celery's own are left out)."""

    @app.task(name="cli.plain", shared=False)
    def plain() -> None:
        """A task the retrofit missed: it runs every duplicate."""

    invoke(app, "migrate")
    result = invoke(app, "status", "--json")
    table = invoke(app, "status")

    assert 0 == result.exit_code, result.output
    tasks = {task["task"]: task for task in json.loads(result.stdout)["tasks"]}
    assert {TASK, "cli.plain"} <= set(tasks)
    assert not any(name.startswith("celery.") for name in tasks)
    assert (True, task_lock(pglock_schema), "session") == (
        tasks[TASK]["locked"],
        tasks[TASK]["lock"],
        tasks[TASK]["scope"],
    )
    assert {"task": "cli.plain", "locked": False} == tasks["cli.plain"]
    assert ["cli.plain", "NO"] in [line.split()[:2] for line in table.stdout.splitlines()]


def test_status_of_one_lock_exits_1_when_free(
    app: Celery, db: Database, procs: Procs, pglock_schema: str
) -> None:
    """status TASK exits 1 while nobody holds the task's lock, 0 with its holder once held."""
    free = invoke(app, "status", TASK)
    start_holder(procs, db.settings.dsn, pglock_schema, task_lock(pglock_schema), task_id="t-h")
    held = invoke(app, "status", TASK, "--json")

    assert 1 == free.exit_code, free.output
    assert "not held" in free.stdout
    assert 0 == held.exit_code, held.output
    assert "t-h" == json.loads(held.stdout)["holder"]["task_id"]


# -- runs --------------------------------------------------------------------------------


def test_runs_json_lists_history_and_exit_1_when_nothing_matches(
    app: Celery, db: Database, pglock_schema: str
) -> None:
    """runs --json returns every field a script needs; no match exits 1; bad --since is 2."""
    name = task_lock(pglock_schema)
    release(db, granted(acquire(db, claim(name, SLOT), "session", None)), FAILED, "boom")
    release(db, granted(acquire(db, claim(name, SLOT), "session", None)), SUCCEEDED)

    found = invoke(app, "runs", "--task", name, "--since", "1h", "--json")
    table = invoke(app, "runs", "--state", "succeeded")
    nothing = invoke(app, "runs", "--state", "running")
    bad = invoke(app, "runs", "--since", "yesterday")

    assert 0 == found.exit_code, found.output
    [run] = json.loads(found.stdout)
    assert RUN_KEYS <= set(run)
    assert ("succeeded", 2, 0) == (run["state"], run["attempts"], run["skips"])
    assert 0 == table.exit_code
    assert name in table.stdout
    assert 1 == nothing.exit_code
    assert 2 == bad.exit_code
    assert "--since" in bad.output


# -- prune -------------------------------------------------------------------------------


def test_prune_reports_counts_and_refuses_bad_ages(
    app: Celery, db: Database, conn: Conn, pg_dsn: str, pglock_schema: str
) -> None:
    """prune deletes old rows (JSON counts); too short or missing ages are usage errors."""
    name = task_lock(pglock_schema)
    release(db, granted(acquire(db, claim(name, SLOT), "session", None)), SUCCEEDED)
    conn.execute(db.tables.render("UPDATE {runs} SET updated_at = now() - interval '9 days'"))

    too_short = invoke(app, "prune", "--older-than", "5m")
    missing = invoke(app, "prune")
    done = invoke(app, "prune", "--older-than", "7d", "--json")
    from_setting = invoke(make_app(pg_dsn, pglock_schema, pglock_ledger_retention="7d"), "prune")

    assert (2, 2) == (too_short.exit_code, missing.exit_code)
    assert "minimum" in too_short.output
    assert "--older-than" in missing.output
    assert 0 == done.exit_code, done.output
    expected = {"runs": 1, "skips": 0, "beat_sends": 0, "holders": 0, "row_locks": 0}
    assert expected == json.loads(done.stdout)["deleted"]
    assert 0 == from_setting.exit_code, from_setting.output


# -- release -----------------------------------------------------------------------------


def test_release_refuses_without_yes_and_the_holder_keeps_its_lock(
    app: Celery, db: Database, conn: Conn, procs: Procs, pglock_schema: str
) -> None:
    """Without --yes release shows the holder, exits 2 and ends nothing."""
    name = task_lock(pglock_schema)
    holder = start_holder(procs, db.settings.dsn, pglock_schema, name, task_id="t-keep")

    result = invoke(app, "release", TASK)

    assert 2 == result.exit_code, result.output
    assert "--yes" in result.output
    assert "t-keep" in result.output
    assert [holder.backend_pid] == lock_holders(conn, name)


def test_release_yes_ends_the_holder_which_notices(
    app: Celery, db: Database, conn: Conn, procs: Procs, pglock_schema: str
) -> None:
    """release NAME --yes terminates the holder's session; the holder learns it lost the lock."""
    name = task_lock(pglock_schema)
    holder = start_holder(procs, db.settings.dsn, pglock_schema, name, task_id="t-end")

    result = invoke(app, "release", name, "--yes", "--json")

    assert 0 == result.exit_code, result.output
    payload = json.loads(result.stdout)
    assert (name, True) == (payload["lock"], payload["released"])
    assert [("t-end", holder.backend_pid)] == [
        (h["task_id"], h["backend_pid"]) for h in payload["terminated"]
    ]
    assert "@" in payload["operator"]
    assert [] == lock_holders(conn, name)
    holder.proc.wait_for_log("LOST", timeout=10)


def test_release_is_audited_with_who_ended_which_sessions(
    app: Celery, db: Database, conn: Conn, procs: Procs, pglock_schema: str
) -> None:
    """release --yes writes an audit row, as the dashboard's release does: who (--by), the
    lock, and the sessions it ended."""
    name = task_lock(pglock_schema)
    holder = start_holder(procs, db.settings.dsn, pglock_schema, name, task_id="t-audit")

    result = invoke(app, "release", name, "--yes", "--by", "oncall-ann")

    assert 0 == result.exit_code, result.output
    query = sql.SQL("SELECT actor, lock_name, detail FROM {} WHERE action = 'release'")
    [(actor, lock, detail)] = conn.execute(
        query.format(sql.Identifier(pglock_schema, "pglock_audit"))
    ).fetchall()
    assert ("oncall-ann", name) == (actor, lock)
    assert [holder.backend_pid] == [h["backend_pid"] for h in detail["terminated"]]


def test_release_refuses_a_lock_outside_the_namespace(
    app: Celery, db: Database, procs: Procs, pglock_schema: str
) -> None:
    """A foreign lock name is refused (exit 2) unless --any-namespace is given."""
    name = f"other-{pglock_schema}:job"
    start_holder(procs, db.settings.dsn, pglock_schema, name)

    refused = invoke(app, "release", name, "--yes")
    allowed = invoke(app, "release", name, "--yes", "--any-namespace")

    assert 2 == refused.exit_code, refused.output
    assert "--any-namespace" in refused.output
    assert 0 == allowed.exit_code, allowed.output


def test_release_of_a_free_lock_exits_1(app: Celery, db: Database) -> None:
    """Releasing a lock nobody holds says so and exits 1."""
    result = invoke(app, "release", TASK, "--yes")

    assert 1 == result.exit_code, result.output
    assert "not held" in result.output


# -- errors ------------------------------------------------------------------------------

COMMANDS = {
    "status": ("status",),
    "status-json": ("status", "--json"),
    "runs": ("runs",),
    "migrate": ("migrate",),
    "prune": ("prune", "--older-than", "7d"),
    "release": ("release", "x:job", "--yes", "--any-namespace"),
}


@pytest.mark.parametrize("args", COMMANDS.values(), ids=COMMANDS.keys())
def test_unreachable_database_exits_3_without_the_password(args: tuple[str, ...]) -> None:
    """Every command names the unreachable server, exits 3 and never prints the password."""
    result = invoke(make_app(UNREACHABLE_DSN, "public"), *args)

    assert 3 == result.exit_code, result.output
    assert "127.0.0.1" in result.stderr
    assert PASSWORD not in result.output
    assert "" == result.stdout


@pytest.mark.parametrize("args", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_misconfigured_database_exits_2_naming_the_fix(
    pg_dsn: str, args: tuple[str, ...]
) -> None:
    """An unknown database is not an outage: every command exits 2 at once, naming the
    fix, without waiting."""
    dsn = pg_dsn.rsplit("/", 1)[0] + "/no_such_db"

    result = invoke(make_app(dsn, "public"), *args)

    assert 2 == result.exit_code, result.output
    assert "check the database name in pglock_dsn" in result.stderr
    assert "waiting for PostgreSQL" not in result.output


def test_missing_dsn_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without pglock_dsn (or PGLOCK_DSN) the command exits 2 naming the setting."""
    monkeypatch.delenv("PGLOCK_DSN", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setitem(sys.modules, "django.conf", None)  # nor a Django configured earlier
    app = Celery("nodsn", set_as_current=False)

    result = invoke(app, "status")

    assert 2 == result.exit_code, result.output
    assert "pglock_dsn" in result.stderr


# -- the real command lines ----------------------------------------------------------------

APP_MODULE = """
from celery import Celery
from celery_pglock import PgLockTask

app = Celery("realcli")
app.conf.update(pglock_dsn={dsn!r}, pglock_schema={schema!r}, pglock_namespace={schema!r})


@app.task(base=PgLockTask, name="realcli.job")
def job():
    pass
"""


def run_celery(
    tmp_path: Path, dsn: str, schema: str, *args: str
) -> subprocess.CompletedProcess[str]:
    """``python -m celery -A realcli pglock *args`` in a subprocess."""
    (tmp_path / "realcli.py").write_text(APP_MODULE.format(dsn=dsn, schema=schema))
    argv = [sys.executable, "-m", "celery", "-A", "realcli", "pglock", *args]
    return subprocess.run(
        argv, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )


def test_celery_command_line_runs_pglock_status(
    tmp_path: Path, db: Database, pg_dsn: str, pglock_schema: str
) -> None:
    """`celery -A proj pglock status --json` works through the celery.commands entry point."""
    done = run_celery(tmp_path, pg_dsn, pglock_schema, "status", "--json")

    assert 0 == done.returncode, done.stderr
    assert pglock_schema == json.loads(done.stdout)["namespace"]


def test_celery_command_line_exit_code_when_database_is_down(tmp_path: Path) -> None:
    """Through the real `celery` script an unreachable database is exit 3, password hidden."""
    done = run_celery(tmp_path, UNREACHABLE_DSN, "public", "runs")

    assert 3 == done.returncode, done.stderr
    assert PASSWORD not in done.stdout + done.stderr


SCHEDULED_APP_MODULE = (
    APP_MODULE
    + """
app.conf.beat_scheduler = "celery_pglock.beat:PgLockScheduler"
app.conf.beat_schedule = {{"tick": {{"task": "realcli.job", "schedule": 60.0}}}}
"""
)


def test_a_long_running_command_waits_for_postgresql_then_runs(
    tmp_path: Path, private_pg: EmbeddedPostgres
) -> None:
    """`pglock rerun` started while PostgreSQL is stopped waits for it (WARNINGs on stderr,
    the next delay in each), then does its work once it answers (here: the slot never
    succeeded, exit 1), where `status` fails at once (exit 3)."""
    (tmp_path / "realcli.py").write_text(
        SCHEDULED_APP_MODULE.format(dsn=private_pg.dsn, schema="public")
    )
    argv = [sys.executable, "-m", "celery", "-A", "realcli", "pglock"]
    subprocess.run([*argv, "migrate"], cwd=tmp_path, capture_output=True, timeout=60, check=True)
    private_pg.stop()
    short = subprocess.run(
        [*argv, "status"], cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    stderr = tmp_path / "rerun.err"
    with stderr.open("w") as err:
        rerun = subprocess.Popen(
            [*argv, "rerun", "tick", "2026-11-29T18:05:00Z", "--reason", "test"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        wait_until(
            lambda: stderr.read_text().count("waiting for PostgreSQL") >= 2,
            timeout=60,
            message="two failed attempts",
        )
        private_pg.start()
        status = rerun.wait(timeout=60)
    finally:
        rerun.kill()
        rerun.wait()
    said = stderr.read_text()

    assert (3, 1) == (short.returncode, status), said
    assert "pglock rerun) is waiting for PostgreSQL: attempt 1 failed, next in 1 s" in said
    assert "PostgreSQL answers" in said
    assert "has not succeeded: nothing to run again" in said


def test_standalone_command_offers_demo() -> None:
    """`celery-pglock --help` lists the demo subcommand."""
    result = CliRunner().invoke(console_cli, ["--help"])

    assert 0 == result.exit_code, result.output
    assert "demo" in result.stdout
