"""Where the dashboard's pictures put things: an entry's strip (one cell per slot) and its
timeline (one row per slot, a bar per attempt from start to end, markers for skips and
waits). Pure: numbers in, shapes out; the templates draw them as inline SVG."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timezone
from functools import cache
from typing import Any

from markupsafe import Markup, escape

CELL = 10  # px, one strip cell
GAP = 2
ROW = 14  # px, one timeline row
LABEL = 190  # px left of the timeline for the slot names
WIDTH = 900  # px of the timeline's time axis
MIN_BAR = 2  # px: the shortest run still shows


def strip_svg(cells: Sequence[dict[str, Any]]) -> Markup:
    """An entry's strip as inline SVG: a cell per slot coloured by its state (a class),
    its tooltip a ``<title>``; every value escaped. Written here rather than in a
    template: the overview draws thousands of cells, and this is several times faster."""
    width, height = strip_width(len(cells)), CELL + 2
    parts = [
        f'<svg class="strip" width="{width}" height="{height}" viewBox="0 0 {width} {height}"'
        f' role="img" aria-label="last {len(cells)} slots">'
    ]
    for n, cell in enumerate(cells):
        state = str(cell["state"])
        classes = f"cell {css(state)}" + (" dup" if cell.get("skips") else "")
        parts.append(
            f'<rect class="{classes}" x="{n * (CELL + GAP)}" y="1" width="{CELL}" '
            f'height="{CELL}" rx="2" data-slot="{escape(cell["slot"])}" '
            f'data-state="{escape(state)}"><title>{escape(cell_title(cell))}</title></rect>'
        )
    parts.append("</svg>")
    return Markup("".join(parts))  # noqa: S704 - built of escaped values and our own markup


def strip_width(count: int) -> int:
    return max(0, count * (CELL + GAP) - GAP)


@cache
def css(state: str) -> str:
    """The CSS class of a state: ``s-`` and its letters and digits (others as ``-``)."""
    return "s-" + "".join(ch if ch.isalnum() else "-" for ch in state)


def cell_title(cell: dict[str, Any]) -> str:
    """The tooltip of one slot: its state, why, and every skipped duplicate's reason."""
    parts = [f"{cell['slot']}: {cell['state']}"]
    if cell.get("reason"):
        parts.append(str(cell["reason"]))
    if cell.get("duration_seconds") is not None:
        parts.append(f"{cell['duration_seconds']:.1f} s")
    if cell.get("attempts") and cell["attempts"] > 1:
        parts.append(f"{cell['attempts']} attempts")
    reasons = cell.get("skip_reasons") or {}
    if reasons:
        told = ", ".join(f"{reason} x{count}" for reason, count in sorted(reasons.items()))
        parts.append(f"skipped duplicates: {told}")
    return " · ".join(parts)


def _x(moment: datetime, since: datetime, until: datetime) -> float:
    span = (until - since).total_seconds() or 1.0
    ratio = (moment - since).total_seconds() / span
    return LABEL + max(0.0, min(1.0, ratio)) * WIDTH


def timeline(
    runs: list[dict[str, Any]],
    skips: list[dict[str, Any]],
    waiting: list[dict[str, Any]],
    *,
    since: datetime,
    until: datetime,
    now: datetime | None = None,
) -> dict[str, Any]:
    """One row per slot (oldest at the top), a bar per attempt, markers for skips and
    waits, and how many bars overlap another in time (runs of one lock at once)."""
    now = now or datetime.now(timezone.utc)
    ordered = sorted(runs, key=lambda r: (r["created_at"], r["slot"]))
    since = zoomed(since, until, [r["started_at"] or r["created_at"] for r in ordered])
    rows = {run["slot"]: n for n, run in enumerate(ordered)}
    extra = {s["slot"] for s in [*skips, *waiting] if s.get("slot") not in rows}
    for slot in sorted(s for s in extra if s is not None):
        rows[slot] = len(rows)
    bars = []
    for run in ordered:
        start = run["started_at"]
        if start is None:
            continue
        end = run["finished_at"] or (now if run["state"] == "running" else start)
        x0 = _x(start, since, until)
        x1 = max(x0 + MIN_BAR, _x(end, since, until))
        bars.append(
            {
                "slot": run["slot"],
                "y": rows[run["slot"]] * ROW + 2,
                "x": x0,
                "width": x1 - x0,
                "css": css(run["state"]),
                "title": _bar_title(run),
                "start": start,
                "end": end,
            }
        )
    marks = [
        _mark(skip, "skip", skip["at"], rows, (since, until), title=f"skipped: {skip['reason']}")
        for skip in skips
        if skip.get("slot") in rows
    ]
    marks += [
        _mark(wait, "wait", wait["waiting_since"], rows, (since, until), title="waiting its turn")
        for wait in waiting
        if wait.get("slot") in rows
    ]
    return {
        "labels": [
            {"slot": slot, "text": _short(slot), "y": n * ROW + ROW - 3} for slot, n in rows.items()
        ],
        "bars": bars,
        "marks": marks,
        "height": max(1, len(rows)) * ROW + 20,
        "width": LABEL + WIDTH + 10,
        "axis_y": max(1, len(rows)) * ROW + 14,
        "overlaps": overlaps(bars),
        "label_x": LABEL - 4,
        "end_x": LABEL + WIDTH,
        "start_x": LABEL,
        "since": since,
    }


def _short(slot: str, most: int = LABEL // 7) -> str:
    """A slot's name as it fits left of the timeline (the whole name in its tooltip)."""
    return slot if len(slot) <= most else slot[: most - 1] + "\N{HORIZONTAL ELLIPSIS}"


def zoomed(since: datetime, until: datetime, moments: list[datetime]) -> datetime:
    """The window's start, moved up to a little before its first run: a window of a day
    with an hour of runs draws that hour across the width."""
    if not moments:
        return since
    first = min(moments)
    margin = (until - first) * 0.02
    return max(since, first - margin)


def _bar_title(run: dict[str, Any]) -> str:
    parts = [f"{run['slot']}: {run['state']}", f"token {run['token']}"]
    parts.append(f"{run['host']} pid {run['pid']}")
    if run.get("duration_seconds") is not None:
        parts.append(f"{run['duration_seconds']:.1f} s")
    if run.get("attempts") and run["attempts"] > 1:
        parts.append(f"{run['attempts']} attempts (the bar is the last)")
    if run.get("reason"):
        parts.append(str(run["reason"]))
    return " · ".join(parts)


def _mark(
    item: dict[str, Any],
    kind: str,
    moment: datetime,
    rows: dict[str, int],
    span: tuple[datetime, datetime],
    *,
    title: str,
) -> dict[str, Any]:
    y = rows[item["slot"]] * ROW + ROW // 2
    x = _x(moment, *span)
    return {"kind": kind, "x": x, "y": y, "title": f"{item['slot']}: {title} at {moment:%H:%M:%S}"}


def overlaps(bars: list[dict[str, Any]]) -> int:
    """How many bars start before an earlier-started one ended."""
    count, latest_end = 0, None
    for bar in sorted(bars, key=lambda b: b["start"]):
        if latest_end is not None and bar["start"] < latest_end:
            count += 1
        latest_end = bar["end"] if latest_end is None else max(latest_end, bar["end"])
    return count
