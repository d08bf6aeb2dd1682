"""``celery-pglock run NAME -- command…``: run any command under a lock, as a child process.

This process takes the lock (session scope, on a connection of its own), records the
run in the ledger when ``--slot`` is given, and keeps the lease alive with the heartbeat
while the command runs; the command learns ``PGLOCK_LOCK``, ``PGLOCK_SLOT`` and
``PGLOCK_TOKEN`` (for ``fence``) from its environment.

Exit status: ``0`` with one line on stderr when skipped; otherwise the command's own
(``128 + N`` when signal N killed it). When the command did not run: ``125`` if
celery-pglock failed (PostgreSQL unreachable, bad option), ``126`` if the command cannot
be executed, ``127`` if it is not found (the convention of ``env``, ``nice``, ``timeout``).

SIGTERM, SIGINT and SIGHUP are forwarded to the command, which decides when to exit.
A Ctrl-C typed in our terminal already reaches it (same process group), so SIGINT is not
sent a second time then.

A lost lock (this process was frozen longer than the lease, or the server ended its
session) means another host may be running the same command now. By default the command
is then terminated (SIGTERM, SIGKILL after ``KILL_AFTER`` seconds) so two copies overlap
as briefly as possible; ``--on-lost continue`` only warns, for commands that must not be
interrupted and fence their writes with ``PGLOCK_TOKEN`` instead.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Literal

from celery_pglock._standalone import LockHandle, LockOptions, describe_skip, hold
from celery_pglock.errors import LockLost, PgLockError

OnLost = Literal["terminate", "continue"]

EXIT_WRAPPER_FAILED = 125
EXIT_CANNOT_EXECUTE = 126
EXIT_NOT_FOUND = 127
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
POLL_INTERVAL = 0.2  # seconds between looks at the lease while the command runs
KILL_AFTER = 10.0  # seconds a terminated command gets before SIGKILL
PREFIX = "celery-pglock run"


class CommandFailed(Exception):
    """The command exited non-zero; raised inside the lock so the ledger records ``failed``."""

    def __init__(self, argv: Sequence[str], returncode: int) -> None:
        self.status = exit_status(returncode)
        super().__init__(f"{Path(argv[0]).name} {_describe_returncode(returncode)}")


class CommandNotStarted(Exception):
    """The command could not be started (not found, not executable)."""

    def __init__(self, argv: Sequence[str], error: OSError) -> None:
        self.status = (
            EXIT_NOT_FOUND if isinstance(error, FileNotFoundError) else EXIT_CANNOT_EXECUTE
        )
        super().__init__(f"cannot run {argv[0]!r}: {error.strerror or error}")


def run_command(
    name: str, argv: Sequence[str], options: LockOptions, slot: str | None, on_lost: OnLost
) -> int:
    """Run ``argv`` under lock ``name``; the exit status for ``celery-pglock run``."""
    _show_library_warnings()
    try:
        return _run_locked(name, list(argv), options, slot, on_lost)
    except (CommandFailed, CommandNotStarted) as exc:
        if isinstance(exc, CommandNotStarted):
            say(str(exc))
        return exc.status
    except PgLockError as exc:  # our messages never carry a password (redacted at the source)
        say(f"error: {exc}")
        return EXIT_WRAPPER_FAILED


def _run_locked(
    name: str, argv: list[str], options: LockOptions, slot: str | None, on_lost: OnLost
) -> int:
    task_name = f"{PREFIX}: {Path(argv[0]).name}"  # not the arguments: they may hold secrets
    try:
        with hold(options, name, slot, task_name=task_name) as handle:
            if handle.skip is not None:
                say(describe_skip(handle.skip))
                return 0
            returncode = supervise(argv, handle, on_lost)
            if returncode != 0:
                raise CommandFailed(argv, returncode)
    except LockLost as exc:  # the command succeeded, but the ledger could not say so
        say(f"warning: {exc}")
    return 0


def supervise(argv: list[str], handle: LockHandle, on_lost: OnLost) -> int:
    """Start the command, forward signals to it, watch the lease; its return code."""
    with _forwarding() as forwarder:
        try:
            child = subprocess.Popen(argv, env=child_env(handle))
        except OSError as exc:
            raise CommandNotStarted(argv, exc) from exc
        forwarder.attach(child)
        return _wait(child, handle, on_lost)


def child_env(handle: LockHandle) -> dict[str, str]:
    return {
        **os.environ,
        "PGLOCK_LOCK": handle.name,
        "PGLOCK_SLOT": handle.slot or "",
        "PGLOCK_TOKEN": str(handle.token),
    }


def _wait(child: subprocess.Popen[bytes], handle: LockHandle, on_lost: OnLost) -> int:
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=POLL_INTERVAL)
        if handle.lost:
            break
    if on_lost == "continue":
        say("warning: the lock was lost; the command goes on (--on-lost continue)")
        return child.wait()
    say("warning: the lock was lost, another host may run the command now: terminating it")
    return _terminate(child)


def _terminate(child: subprocess.Popen[bytes]) -> int:
    child.terminate()
    try:
        return child.wait(timeout=KILL_AFTER)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


def exit_status(returncode: int) -> int:
    """A shell's view of a return code: ``128 + N`` for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _describe_returncode(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-returncode).name}"
    return f"exited with status {exit_status(returncode)}"


class _Forwarder:
    """Signal handler: pass the signal on to the child (remembered until it exists)."""

    def __init__(self) -> None:
        self.child: subprocess.Popen[bytes] | None = None
        self.pending: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT and _terminal_interrupts_child():
            return  # the terminal sent it to the child too
        if self.child is None:
            self.pending.append(signum)
        else:
            self.child.send_signal(signum)  # a no-op once the child has exited

    def attach(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        for signum in self.pending:
            child.send_signal(signum)


@contextlib.contextmanager
def _forwarding() -> Iterator[_Forwarder]:
    forwarder = _Forwarder()
    if threading.current_thread() is not threading.main_thread():
        yield forwarder  # only the main thread may set handlers (e.g. embedded use)
        return
    previous = {signum: signal.signal(signum, forwarder) for signum in FORWARDED}
    try:
        yield forwarder
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _terminal_interrupts_child() -> bool:
    """True when we (and so the child) are the foreground process group of our terminal."""
    try:
        fd = os.open("/dev/tty", os.O_RDONLY)
    except OSError:
        return False  # no controlling terminal: cron, systemd, containers
    try:
        return os.tcgetpgrp(fd) == os.getpgrp()
    except OSError:
        return False
    finally:
        os.close(fd)


def _show_library_warnings() -> None:
    """Print the library's warnings (a lost lock, a missing lease) in our style."""
    library = logging.getLogger("celery_pglock")
    if library.handlers or logging.getLogger().handlers:
        return  # the environment configured logging already
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PREFIX}: %(message)s"))
    handler.setLevel(logging.WARNING)
    library.addHandler(handler)


def say(message: str) -> None:
    print(f"{PREFIX}: {message}", file=sys.stderr, flush=True)
