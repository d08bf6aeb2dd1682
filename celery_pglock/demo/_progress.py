"""Live progress on stderr: a rich panel on a terminal, plain lines otherwise.

stdout is kept for the report (and ``--json``), so progress never mixes into it.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.live import Live
from rich.table import Table

PLAIN_EVERY = 5.0  # seconds between plain progress lines


@dataclass(frozen=True)
class Snapshot:
    """Where a run stands."""

    phase: str
    elapsed: float
    left: float
    due: int
    completed: int
    running: int
    skipped: int


class Display:
    """Shows one run's progress; ``note`` prints a line that stays (chaos, phases)."""

    def __init__(self, title: str, stream: TextIO | None = None, *, quiet: bool = False) -> None:
        self.title = title
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self.console = Console(file=self.stream, highlight=False)
        self.live: Live | None = None
        self._last_plain = 0.0

    def __enter__(self) -> Display:
        if not self.quiet and self.console.is_terminal:
            self.live = Live(console=self.console, auto_refresh=False, transient=True)
            self.live.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None

    def note(self, line: str | None) -> None:
        if line is None or self.quiet:
            return
        if self.live is not None:
            self.live.console.print(f"  {line}")
        else:
            self._plain(f"[{self.title}] {line}")

    def update(self, snap: Snapshot) -> None:
        if self.quiet:
            return
        if self.live is not None:
            self.live.update(self._panel(snap), refresh=True)
            return
        now = time.monotonic()
        if now - self._last_plain >= PLAIN_EVERY:
            self._last_plain = now
            self._plain(f"[{self.title}] {_line(snap)}")

    def _plain(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _panel(self, snap: Snapshot) -> Table:
        table = Table.grid(padding=(0, 2))
        table.add_row(f"[bold]{self.title}[/bold]", snap.phase)
        table.add_row("time left", f"{snap.left:4.0f} s   (elapsed {snap.elapsed:.0f} s)")
        table.add_row("slots due", str(snap.due))
        table.add_row("executed", f"{snap.completed}   (running now: {snap.running})")
        table.add_row("skipped", str(snap.skipped))
        return table


def _line(snap: Snapshot) -> str:
    return (
        f"{snap.phase}: {snap.left:.0f} s left, slots due {snap.due}, executed "
        f"{snap.completed}, running {snap.running}, skipped {snap.skipped}"
    )
