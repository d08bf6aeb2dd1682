"""Real ``celery beat`` and ``celery worker`` processes of the demo app, by pid.

Each is a ``celery_pglock.testing._processes.Proc`` (own session, log file), asked to die
with the demo should the demo itself be killed (Linux ``PR_SET_PDEATHSIG``).
``Fleet.stop_all`` stops beats before the workers they feed.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from celery_pglock.demo._schedule import APP_MODULE
from celery_pglock.testing._processes import STOP_TIMEOUT, Proc

READY_MARKERS = {
    "beat": "beat: Starting...",
    "worker": " ready.",
    "web": "celery-pglock dashboard on",
}
WORKER_OPTIONS = ("--without-gossip", "--without-mingle", "--without-heartbeat")


class ProcessFailed(Exception):
    """A demo process exited or never became ready; the message carries its log tail."""


class Process(Proc):
    """One demo process: a beat or a worker, with its log file."""

    def __init__(
        self, name: str, role: str, argv: list[str], log_path: Path, env: Mapping[str, str]
    ):
        super().__init__(argv, log_path=log_path, env=env, name=name, die_with_parent=True)
        self.role = role
        self.started_at = time.time()

    @property
    def ready(self) -> bool:
        return READY_MARKERS[self.role] in self.log_text()


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

    def start_web(self) -> tuple[Process, str]:
        """``celery pglock web`` on a free loopback port: the process and its URL."""
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        args = ["pglock", "web", "--bind", f"127.0.0.1:{port}"]
        return self._start("web", "web", args), f"http://127.0.0.1:{port}/"

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
                    raise ProcessFailed(
                        f"{proc.name} exited ({proc.returncode}) at start-up:\n{proc.log_tail()}"
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
            proc.stop(max(0.0, deadline - time.monotonic()))

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
