"""``celery-pglock run NAME -- command…`` as a real subprocess against a real PostgreSQL.

Each test runs the installed console script, so the entry point, exit statuses, stderr,
the command's environment and signal forwarding are what a crontab line would see.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_pglock import advisory_lock
from celery_pglock._ledger import FAILED, SUCCEEDED
from celery_pglock.store._database import close_all
from tests.fixtures.procs import Proc, Procs, wait_until
from tests.integration.locking import Conn
from tests.integration.test_standalone import PASSWORD, SLOT, start_holder, the_run

pytestmark = pytest.mark.integration

SCRIPT = Path(sys.executable).with_name("celery-pglock")
COMMAND_LINE = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "celery_pglock"]
UNREACHABLE_DSN = f"postgresql://app:{PASSWORD}@127.0.0.1:1/app"

# The command of the signal tests: says READY, then exits 7 on the first signal it gets,
# after writing the signal's number to the file named by its argument.
SIGNALLED_CHILD = """
import signal, sys, time
def on_signal(signum, frame):
    open(sys.argv[1], "w").write(str(signum))
    sys.exit(7)
signal.signal(signal.SIGTERM, on_signal)
signal.signal(signal.SIGINT, on_signal)
print("READY", flush=True)
time.sleep(60)
"""
SLEEPER = "print('READY', flush=True); import time; time.sleep(60)"


@dataclass(frozen=True)
class Cli:
    """``celery-pglock run`` pointed at this test's schema, lock name and directory."""

    dsn: str
    schema: str
    name: str
    cwd: Path

    def argv(self, *args: str) -> list[str]:
        """``celery-pglock run --dsn … --schema … NAME *args`` (options, ``--``, command)."""
        return [*COMMAND_LINE, "run", "--dsn", self.dsn, "--schema", self.schema, self.name, *args]

    def __call__(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run to completion, stdout and stderr kept apart."""
        return subprocess.run(
            self.argv(*args), capture_output=True, text=True, timeout=30, cwd=self.cwd, check=False
        )

    def start(self, procs: Procs, *args: str) -> Proc:
        """Start in the background (its own session, no terminal), output in its log."""
        return procs.start(self.argv(*args), name="run")

    def the_run(self, conn: Conn, slot: str = SLOT) -> dict[str, Any]:
        return the_run(conn, self.schema, self.name, slot)


@pytest.fixture(autouse=True)
def _close_pools() -> Iterator[None]:
    yield
    close_all()


@pytest.fixture
def cli(pg_dsn: str, pglock_schema: str, tmp_path: Path) -> Cli:
    """The command line for a lock name of this test only."""
    return Cli(pg_dsn, pglock_schema, f"{pglock_schema}:cron", tmp_path)


def test_exit_status_is_the_commands_and_the_ledger_follows(cli: Cli, pg_conn: Conn) -> None:
    """Exit 3 is passed on and recorded failed; the retry succeeds; the next run skips."""
    failed = cli("--slot", SLOT, "--", "sh", "-c", "exit 3")
    failed_row = cli.the_run(pg_conn)
    retried = cli("--slot", SLOT, "--", "true")
    again = cli("--slot", SLOT, "--", "touch", "ran")

    assert (3, 0, 0) == (failed.returncode, retried.returncode, again.returncode), failed.stderr
    assert (FAILED, "CommandFailed: sh exited with status 3") == (
        failed_row["state"],
        failed_row["reason"],
    )
    row = cli.the_run(pg_conn)
    assert (SUCCEEDED, 2) == (row["state"], row["attempts"])
    assert [f"celery-pglock run: skipped lock {cli.name!r} slot {SLOT!r}: done"] == [
        line.split(",")[0] for line in again.stderr.splitlines()
    ]
    assert not (cli.cwd / "ran").exists()


def test_skipped_while_held_exits_zero_with_one_line_naming_the_holder(
    cli: Cli, procs: Procs
) -> None:
    """Another process holds the lock: exit 0, one stderr line with reason and holder."""
    holder = start_holder(procs, cli.dsn, cli.schema, cli.name)

    done = cli("--", "touch", "ran")

    assert 0 == done.returncode, done.stderr
    [line] = done.stderr.splitlines()
    assert f"skipped lock {cli.name!r}: locked, held by pid {holder.pid} on " in line
    assert "" == done.stdout
    assert not (cli.cwd / "ran").exists()


def test_wait_runs_the_command_once_the_holder_is_done(cli: Cli, procs: Procs) -> None:
    """--wait blocks while another process holds the lock, then runs the command."""
    start_holder(procs, cli.dsn, cli.schema, cli.name, seconds=1)

    done = cli("--wait", "--timeout", "20", "--", "touch", "ran")

    assert 0 == done.returncode, done.stderr
    assert (cli.cwd / "ran").exists()


def test_command_gets_lock_slot_and_token_in_its_environment(cli: Cli, pg_conn: Conn) -> None:
    """PGLOCK_LOCK, PGLOCK_SLOT and PGLOCK_TOKEN (the ledger's token) reach the command."""
    script = 'echo "$PGLOCK_LOCK|$PGLOCK_SLOT|$PGLOCK_TOKEN" > env.txt'

    done = cli("--slot", SLOT, "--", "sh", "-c", script)

    assert 0 == done.returncode, done.stderr
    token = cli.the_run(pg_conn)["token"]
    assert f"{cli.name}|{SLOT}|{token}" == (cli.cwd / "env.txt").read_text().strip()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_are_forwarded_to_the_command(
    cli: Cli, procs: Procs, pg_conn: Conn, sig: signal.Signals
) -> None:
    """A signal to celery-pglock reaches the command; its exit status is passed on."""
    got = cli.cwd / "signal.txt"
    wrapper = cli.start(
        procs, "--slot", SLOT, "--", sys.executable, "-c", SIGNALLED_CHILD, str(got)
    )
    wrapper.wait_for_log("READY", timeout=20)

    os.kill(wrapper.pid, sig)

    assert 7 == wrapper.wait(timeout=10), wrapper.log_tail()
    assert str(int(sig)) == got.read_text()
    assert FAILED == cli.the_run(pg_conn)["state"]


def test_lost_lock_terminates_the_command(cli: Cli, procs: Procs) -> None:
    """Frozen past its lease, celery-pglock loses the lock, and on waking stops the command."""
    wrapper = cli.start(procs, "--lease", "1", "--", sys.executable, "-c", SLEEPER)
    wrapper.wait_for_log("READY", timeout=20)

    wrapper.freeze(tree=False)  # the command runs on; only its supervisor stops
    wait_until(lambda: lock_is_free(cli), timeout=10, message="the lease to free the lock")
    wrapper.thaw(tree=False)

    assert 128 + signal.SIGTERM == wrapper.wait(timeout=15), wrapper.log_tail()
    assert "the lock was lost" in wrapper.log_text()


def lock_is_free(cli: Cli) -> bool:
    """One try at the lock (released at once)."""
    with advisory_lock(cli.name, dsn=cli.dsn, schema=cli.schema) as lock:
        return lock.acquired


def test_missing_command_exits_127(cli: Cli) -> None:
    """A command that does not exist: 127 and a message, as env and timeout do."""
    done = cli("--", "no-such-command-pglock")

    assert 127 == done.returncode
    assert "cannot run 'no-such-command-pglock'" in done.stderr


def test_unreachable_database_exits_125_without_the_password(tmp_path: Path) -> None:
    """celery-pglock's own failure is 125; the message names the server, not the password."""
    done = Cli(UNREACHABLE_DSN, "public", "cron", tmp_path)("--", "touch", "ran")

    assert 125 == done.returncode
    assert "127.0.0.1" in done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    assert not (tmp_path / "ran").exists()


def test_timeout_without_wait_is_refused(tmp_path: Path) -> None:
    """--timeout without --wait fails (125) before anything is locked or run."""
    done = Cli(UNREACHABLE_DSN, "public", "cron", tmp_path)("--timeout", "5", "--", "touch", "ran")

    assert 125 == done.returncode
    assert "needs wait=True (--wait)" in done.stderr
    assert not (tmp_path / "ran").exists()


def test_a_command_whose_lock_connection_died_is_recorded_failed(
    cli: Cli, procs: Procs, pg_conn: Conn
) -> None:
    """The lock's session ends while the command runs (the server ended it): the command
    is stopped and its attempt recorded ``failed``, as a task's would be."""
    wrapper = cli.start(procs, "--slot", SLOT, "--", sys.executable, "-c", SLEEPER)
    wrapper.wait_for_log("READY", timeout=20)
    backend = cli.the_run(pg_conn)["backend_pid"]

    pg_conn.execute("SELECT pg_terminate_backend(%s)", (backend,))

    assert 128 + signal.SIGTERM == wrapper.wait(timeout=15), wrapper.log_tail()
    run = cli.the_run(pg_conn)
    assert (FAILED, 1) == (run["state"], run["attempts"])
