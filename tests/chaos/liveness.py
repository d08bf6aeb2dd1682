"""Invariant (f), liveness: how long each beat entry went without a successful run.

What an on-call engineer asks of a periodic job: when did it last succeed? Per entry, the
stretches between consecutive successes (a run's end, PostgreSQL's ``finished_at``; the
window's edges close the first and the last one) are measured. A slot superseded by a
newer success needs no accounting: the newer success ends the stretch. A slot lost with no
newer success leaves the stretch open until the window ends.

From a stretch, the time the entry could not run is deducted: PostgreSQL unreachable (a
restart, a failover), the PgBouncer in front of its worker restarting, its worker cut off
(a blackhole), no worker consuming its queue (all killed or starting). What is left must
stay within the documented bound (docs/guarantees.md, "How long a periodic job may go
without success"): ``recovery`` = ``pglock_lease`` + the entry's interval + its run time,
plus 2 s, and one more ``recovery`` for each fault injected in between that could cost
the entry a run (its running task killed, frozen or cut off; its worker killed; an
outage; the beat leader lost). A run lost for any other reason has no allowance.

Pure functions over what the campaign recorded (epoch seconds), tested on made-up
histories in ``tests/unit/test_chaos_invariants.py``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

SLACK = 2.0  # seconds: a worker picking the message up, bookkeeping, a loaded machine


@dataclass(frozen=True)
class Timing:
    """What an entry's recovery takes: its lease, its interval, its run time (seconds)."""

    lease: float
    interval: float
    run: float

    @property
    def recovery(self) -> float:
        """Lock free again (the lease), the next slot due (the interval), its run."""
        return self.lease + self.interval + self.run


@dataclass(frozen=True)
class Disruption:
    """A fault as the entries felt it: from ``start`` to ``end`` (epoch seconds), for
    ``entries`` (None: every entry); ``unreachable``: the entry could not run meanwhile,
    so that time is deducted; ``counts``: an injected fault, which allows one more
    recovery (a consequence of one, such as a queue left without a worker, does not)."""

    start: float
    end: float
    what: str
    entries: frozenset[str] | None = None
    unreachable: bool = False
    counts: bool = True

    def concerns(self, entry: str) -> bool:
        return self.entries is None or entry in self.entries


@dataclass(frozen=True)
class Gap:
    """One stretch of an entry without a successful run."""

    entry: str
    start: float
    end: float
    deducted: float  # seconds the entry could not run
    faults: int  # disruptions that hit the entry in between
    recovery: float

    @property
    def seconds(self) -> float:
        """The stretch, the time the entry could not run deducted."""
        return self.end - self.start - self.deducted

    @property
    def allowed(self) -> float:
        return (1 + self.faults) * self.recovery + SLACK

    def __str__(self) -> str:
        return (
            f"{self.entry}: {self.seconds:.1f} s without a success from {_clock(self.start)} "
            f"to {_clock(self.end)} ({self.end - self.start:.1f} s, {self.deducted:.1f} s "
            f"unreachable deducted; {self.faults} faults in between), bound {self.allowed:.1f} s"
        )


def entry_gaps(
    entry: str,
    successes: Iterable[float],
    window: tuple[float, float],
    disruptions: Iterable[Disruption],
    timing: Timing,
) -> list[Gap]:
    """Every stretch of ``entry`` without a success inside ``window``, judged."""
    start, end = window
    ends = sorted(moment for moment in successes if start < moment < end)
    before = [moment for moment in successes if moment <= start]
    edges = [max(before, default=start), *ends, end]
    felt = [d for d in disruptions if d.concerns(entry)]
    return [
        Gap(entry, a, b, _unreachable(felt, a, b), _faults(felt, a, b), timing.recovery)
        for a, b in itertools.pairwise(edges)
        if b > a
    ]


def worst(gaps: Iterable[Gap]) -> Gap | None:
    """The longest stretch (the time the entry could not run deducted)."""
    return max(gaps, key=lambda gap: gap.seconds, default=None)


def over_bound(gaps: Iterable[Gap]) -> list[Gap]:
    """The stretches longer than their bound: each a broken promise."""
    return [gap for gap in gaps if gap.seconds > gap.allowed]


def _faults(felt: list[Disruption], start: float, end: float) -> int:
    return sum(1 for d in felt if d.counts and d.start <= end and d.end >= start)


def _unreachable(felt: list[Disruption], start: float, end: float) -> float:
    """Seconds of ``start``..``end`` inside the union of the unreachable disruptions."""
    spans = sorted(
        (max(d.start, start), min(d.end, end))
        for d in felt
        if d.unreachable and d.start < end and d.end > start
    )
    total, reach = 0.0, start
    for low, high in spans:
        begin = max(low, reach)
        if high > begin:
            total += high - begin
            reach = high
    return total


def _clock(epoch: float) -> str:
    return datetime.fromtimestamp(epoch).strftime("%H:%M:%S.%f")[:-3]


def idle_spans(
    up: Iterable[tuple[float, float]], window: tuple[float, float]
) -> list[tuple[float, float]]:
    """The parts of ``window`` that no ``up`` span covers (a queue without a consumer)."""
    start, end = window
    spans, reach = [], start
    for low, high in sorted(up):
        if low > reach:
            spans.append((reach, min(low, end)))
        reach = max(reach, high)
        if reach >= end:
            break
    if reach < end:
        spans.append((reach, end))
    return [(a, b) for a, b in spans if b > a]
