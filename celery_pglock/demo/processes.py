"""Real ``celery beat`` and ``celery worker`` processes of the demo app, by pid.

Each process runs in its own session (a Ctrl-C meant for the demo does not reach it; the
demo decides how each one stops) with its output in a log file, and is asked to die with
the demo should the demo itself be killed (Linux ``PR_SET_PDEATHSIG``). ``Fleet.stop_all``
stops beats before the workers they feed: SIGCONT (a frozen process cannot exit), SIGTERM,
a grace period, then SIGKILL for the process and whatever is left of its children.
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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from celery_pglock.demo.schedule import APP_MODULE

STOP_TIMEOUT = 10.0
READY_MARKERS = {"beat": "beat: Starting...", "worker": " ready."}
WORKER_OPTIONS = ("--without-gossip", "--without-mingle", "--without-heartbeat")
_PR_SET_PDEATHSIG = 1


class ProcessFailed(Exception):
    """A demo process exited or never became ready; the message carries its log tail."""


class Process:
    """One subprocess with its log file."""

    def __init__(
        self, name: str, role: str, argv: list[str], log_path: Path, env: Mapping[str, str]
    ):
        self.name = name
        self.role = role
        self.log_path = log_path
        self.started_at = time.time()
        with log_path.open("ab") as log:
            self.popen = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - the demo starts no threads
            )

    def __repr__(self) -> str:
        return f"<{self.name} pid={self.pid}>"

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None

    @property
    def ready(self) -> bool:
        return READY_MARKERS[self.role] in self.log_text()

    def family(self) -> list[int]:
        """This process and its descendants (a prefork worker's pool processes)."""
        tree = _children_map()
        found, pending = [self.pid], list(tree.get(self.pid, []))
        while pending:
            pid = pending.pop()
            found.append(pid)
            pending.extend(tree.get(pid, []))
        return found

    def kill(self) -> list[int]:
        """SIGKILL the process and its children, like a container dying; their pids."""
        family = self.family()
        _signal_all(family, signal.SIGKILL)
        self.popen.wait()
        return family

    def freeze(self) -> list[int]:
        """SIGSTOP the process and its children (a long GC pause, a paused VM)."""
        family = self.family()
        _signal_all(family, signal.SIGSTOP)
        return family

    def thaw(self) -> None:
        _signal_all(self.family(), signal.SIGCONT)

    def terminate(self) -> None:
        """Ask it to stop (after SIGCONT, in case it is frozen); see ``finish_stop``."""
        if self.alive:
            self.thaw()
            _signal_all([self.pid], signal.SIGTERM)

    def finish_stop(self, deadline: float) -> None:
        """Wait until ``deadline`` for it to exit, then SIGKILL it and its leftovers."""
        family = self.family()
        try:
            self.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_all([self.pid], signal.SIGKILL)
            self.popen.wait()
        _signal_all(family[1:], signal.SIGKILL)

    def log_text(self) -> str:
        try:
            return self.log_path.read_bytes().decode(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 25) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


class Fleet:
    """The beats and workers of one demo run."""

    def __init__(self, log_dir: Path, env: Mapping[str, str], *, concurrency: int) -> None:
        self.log_dir = log_dir
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.concurrency = concurrency
        self.processes: list[Process] = []

    def start_beat(self, *, stock: bool) -> Process:
        """A ``celery beat``; the stock one keeps its schedule in its own shelve file."""
        name = f"beat-{self._count('beat') + 1}"
        extra = ["--schedule", str(self.log_dir / f"{name}-schedule")] if stock else []
        return self._start(name, "beat", ["beat", "--loglevel", "INFO", *extra])

    def start_worker(self) -> Process:
        name = f"worker-{self._count('worker') + 1}"
        args = ["worker", "--loglevel", "INFO", "--hostname", f"{name}@%h"]
        args += ["--pool", "prefork", "--concurrency", str(self.concurrency), *WORKER_OPTIONS]
        return self._start(name, "worker", args)

    def live(self, role: str) -> list[Process]:
        return [p for p in self.processes if p.role == role and p.alive]

    def owner_of(self, pid: int) -> Process | None:
        """The live process whose tree contains ``pid``."""
        return next((p for p in self.processes if p.alive and pid in p.family()), None)

    def wait_ready(
        self, processes: Iterable[Process], timeout: float, tick: Callable[[], None]
    ) -> None:
        """Wait until every process logged it is ready; raise ``ProcessFailed`` naming why not."""
        pending = list(processes)
        deadline = time.monotonic() + timeout
        while pending:
            for proc in pending:
                if not proc.alive:
                    status = proc.popen.returncode
                    raise ProcessFailed(
                        f"{proc.name} exited ({status}) at start-up:\n{proc.log_tail()}"
                    )
            pending = [p for p in pending if not p.ready]
            if pending and time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{pending[0].name} not ready after {timeout:.0f} s:\n{pending[0].log_tail()}"
                )
            tick()
            time.sleep(0.1)

    def stop(self, role: str | None = None, timeout: float = STOP_TIMEOUT) -> None:
        """Stop every process (of one role), all at once; SIGKILL what outlives ``timeout``."""
        chosen = [p for p in self.processes if role is None or p.role == role]
        for proc in chosen:
            proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in chosen:
            proc.finish_stop(deadline)

    def stop_all(self) -> None:
        """Beats first (no new messages), then workers."""
        try:
            self.stop("beat")
        finally:
            self.stop()

    def _count(self, role: str) -> int:
        return sum(1 for p in self.processes if p.role == role)

    def _start(self, name: str, role: str, args: list[str]) -> Process:
        argv = [sys.executable, "-m", "celery", "--app", APP_MODULE, *args]
        proc = Process(name, role, argv, self.log_dir / f"{name}.log", self.env)
        self.processes.append(proc)
        return proc


# Loaded here, in the demo process: between fork and exec a child should only call prctl.
_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def _die_with_parent() -> None:
    """In the child, before exec: get SIGKILLed if the demo process dies (Linux only)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def _signal_all(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, sig)
