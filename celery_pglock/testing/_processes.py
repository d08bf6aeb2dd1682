"""Real processes by pid: start one in its own session with its output in a log file,
freeze, thaw, kill it (and its process tree), stop it for good.

Used by the demo, the test suite and the benchmarks. Each process runs in its own
session, so a Ctrl-C meant for the caller does not reach it: the caller decides how each
one dies. ``Proc.stop`` sends SIGCONT (a frozen process cannot exit), SIGTERM, waits, then
SIGKILLs the process and whatever is left of its session.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

__all__ = ["STOP_TIMEOUT", "Proc", "wait_until"]

T = TypeVar("T")

STOP_TIMEOUT = 10.0  # seconds a process gets to exit after SIGTERM
_LOG_TAIL_LINES = 60


def wait_until(
    predicate: Callable[[], T],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    message: str = "condition",
    ignore: tuple[type[BaseException], ...] = (),
) -> T:
    """Call ``predicate`` until it returns something truthy, and return that.

    Raises AssertionError naming ``message`` and the last value once ``timeout`` seconds
    have passed. Exceptions of the ``ignore`` types count as "not yet" (e.g. a server
    that is still starting); the last one is reported.
    """
    deadline = time.monotonic() + timeout
    while True:
        last: object
        try:
            value = predicate()
        except ignore as exc:
            last = exc
        else:
            if value:
                return value
            last = value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:g}s waiting for {message}; last value: {last!r}"
            )
        time.sleep(interval)


class Proc:
    """A subprocess in its own session, logging to ``log_path``."""

    def __init__(
        self,
        argv: Sequence[str],
        *,
        log_path: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        name: str | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        self.name = name or Path(self.argv[0]).name
        with log_path.open("ab") as log:
            # Own session: a Ctrl-C meant for pytest does not hit the workers, and the
            # test decides when and how each process dies.
            self.popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=None if env is None else dict(env),
                cwd=cwd,
                start_new_session=True,
                # Only for callers that start no threads (the demo): see _die_with_parent.
                preexec_fn=_die_with_parent if die_with_parent else None,  # noqa: PLW1509
            )

    def __repr__(self) -> str:
        return f"<Proc {self.name} pid={self.pid} returncode={self.returncode}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """Exit status (negative: killed by that signal), or None while running."""
        return self.popen.poll()

    @property
    def alive(self) -> bool:
        return self.returncode is None

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        """Wait for the process to exit on its own and return its exit status."""
        return self.popen.wait(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM (after SIGCONT, should it be frozen), wait up to ``timeout``, then SIGKILL.

        Whatever is left of its session afterwards (the pool of a SIGKILLed worker, even
        once orphaned) is SIGKILLed too.
        """
        self.terminate()
        if self.alive:
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(self.pid, signal.SIGKILL)
                self.popen.wait()
        _kill_all(self.session_members())
        return self.popen.wait()

    def terminate(self) -> None:
        """Send SIGTERM (after SIGCONT, should it be frozen) without waiting."""
        if self.alive:
            self.thaw()
            self._signal(self.pid, signal.SIGTERM)

    def kill(self, *, tree: bool = True) -> int:
        """SIGKILL the process (and, by default, its descendants, like a dying container).

        With ``tree=False`` its children live on as orphans, as after an OOM kill.
        """
        family = self.descendants() if tree else []
        self._signal(self.pid, signal.SIGKILL)
        _kill_all(family)
        return self.popen.wait()

    def freeze(self, *, tree: bool = True) -> None:
        """SIGSTOP the process (and its descendants): a GC pause or a paused VM."""
        for pid in self._targets(tree):
            self._signal(pid, signal.SIGSTOP)

    def thaw(self, *, tree: bool = True) -> None:
        """SIGCONT what :meth:`freeze` stopped."""
        for pid in self._targets(tree):
            self._signal(pid, signal.SIGCONT)

    def family(self) -> list[int]:
        """This process and its descendants (a prefork worker's pool processes)."""
        return [self.pid, *self.descendants()]

    def children(self) -> list[int]:
        """Pids of the direct children (e.g. a prefork worker's pool processes)."""
        return sorted(_children_map(_proc_table()).get(self.pid, []))

    def descendants(self) -> list[int]:
        """Pids of children, grandchildren, …"""
        tree = _children_map(_proc_table())
        found: list[int] = []
        pending = list(tree.get(self.pid, []))
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending.extend(tree.get(pid, []))
        return sorted(found)

    def session_members(self) -> list[int]:
        """Live pids in this process's session: its descendants, orphaned ones included.

        Processes that start their own session (a PostgreSQL server started through
        pg_ctl) are not included: they are not ours to reap.
        """
        return sorted(pid for pid, _, sid in _proc_table() if sid == self.pid and pid != self.pid)

    def log_text(self) -> str:
        """Everything the process wrote so far (stdout and stderr interleaved)."""
        try:
            return self.log_path.read_bytes().decode(errors="replace")
        except OSError:  # not written yet, or its folder already cleaned up
            return ""

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(self, text: str, timeout: float = 15.0) -> None:
        """Wait until ``text`` appears in the log; fail at once if the process exits first."""

        def logged() -> bool:
            if text in self.log_text():
                return True
            if not self.alive:
                raise AssertionError(
                    f"{self.name} exited ({self.returncode}) before logging {text!r}:\n"
                    f"{self.log_tail()}"
                )
            return False

        wait_until(logged, timeout=timeout, message=f"{text!r} in the log of {self.name}")

    def _targets(self, tree: bool) -> list[int]:
        return [self.pid, *self.descendants()] if tree else [self.pid]

    def _signal(self, pid: int, sig: signal.Signals) -> None:
        # The process may exit between our look-up and the signal: that is fine.
        if pid != self.pid or self.alive:
            _send(pid, sig)


# Loaded here, in the parent: between fork and exec a child should only call prctl.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILLed if the parent dies (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _proc_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every live process, from /proc (no psutil needed)."""
    table: list[tuple[int, int, int]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # The command name may contain spaces and parentheses: split after the last ')'.
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z":  # zombies are dead already; only their parent can reap them
            table.append((int(entry.name), int(fields[1]), int(fields[3])))
    return table


def _children_map(table: list[tuple[int, int, int]]) -> dict[int, list[int]]:
    """Parent pid -> child pids."""
    tree: dict[int, list[int]] = {}
    for pid, ppid, _ in table:
        tree.setdefault(ppid, []).append(pid)
    return tree


def _kill_all(pids: Sequence[int]) -> None:
    for pid in pids:
        _send(pid, signal.SIGKILL)


def _send(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile: fine
        os.kill(pid, sig)
