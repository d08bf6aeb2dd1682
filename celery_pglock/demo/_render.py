"""The report as text: a table per run, what the faults did, a verdict, a comparison."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

COLUMNS = (
    ("slots due", "slots_due"),
    ("runs", "executions"),
    ("double", "double_executions"),
    ("missed", "missed_slots"),
)
FAULT_COLUMNS = (("killed", "interrupted"), ("fenced", "stale_writes_rejected"))
WIDTH = 120  # when stdout is not a terminal
REASONS = {
    "locked": "skipped 'locked': the task was still running (or its frozen holder's lease "
    "had not yet run out)",
    "done": "skipped 'done': the slot had already run (a redelivered duplicate)",
}
COMPARED = (
    ("slots due", "slots_due"),
    ("executions", "executions"),
    ("double executions", "double_executions"),
    ("slots run twice or more", "slots_run_twice"),
    ("duplicates skipped", "skipped_total"),
    ("missed slots", "missed_slots"),
)


def title(run: dict[str, Any]) -> str:
    what = "with celery-pglock" if run["lock"] else "stock Celery (no lock)"
    return (
        f"{what}: {run['beats']} beat(s), {run['workers']} worker(s), "
        f"{run['duration_s']:g} s, broker {run['broker']}"
    )


def console() -> Console:
    """stdout; wide enough for the tables even when it is a pipe or a file."""
    out = Console(highlight=False)
    return out if out.is_terminal else Console(highlight=False, width=WIDTH)


def run_table(run: dict[str, Any]) -> Table:
    """One row per task: what was due, what ran, what the lock turned away and why."""
    columns = COLUMNS + tuple(c for c in FAULT_COLUMNS if run["totals"][c[1]])
    table = Table(title=title(run), box=box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    table.add_column("task", no_wrap=True)
    table.add_column("every", justify="right")
    for header, _ in columns:
        table.add_column(header, justify="right")
    table.add_column("skipped (why)")
    table.add_column("parallel", justify="right")
    for name, stats in run["tasks"].items():
        every = f"{stats['every_s']:g} s"
        counts = [str(stats[key]) for _, key in columns]
        parallel = str(stats["max_parallel"])
        table.add_row(name.rsplit(".", 1)[-1], every, *counts, _reasons(stats["skipped"]), parallel)
    total = run["totals"]
    counts = [str(total[key]) for _, key in columns]
    table.add_row("total", "", *counts, _reasons(total["skipped"]), "", style="bold")
    return table


def notes(run: dict[str, Any]) -> list[str]:
    """Lines under the table: beat, faults, redeliveries, verdict."""
    lines = []
    if run["lock"] and run.get("beat"):
        lines.append(_beat(run))
    elif not run["lock"]:
        lines.append(f"beat: every one of the {run['beats']} stock beats sends every slot")
    lines += [_failover(item) for item in run.get("failover", [])]
    lines += [_freeze(item, locked=run["lock"]) for item in run.get("freezes", [])]
    lines += [_event(event, locked=run["lock"]) for event in run["chaos"]]
    lines = [line for line in lines if line]
    if run["redeliveries_injected"]:
        lines.append(_redeliveries(run))
    lines += [REASONS[r] for r in REASONS if r in run["totals"]["skipped"]]
    lines.append(_verdict(run))
    return lines


def print_run(console: Console, run: dict[str, Any]) -> None:
    console.print(run_table(run))
    for line in notes(run):
        console.print(f"  {line}")
    console.print()


def print_comparison(console: Console, runs: list[dict[str, Any]]) -> None:
    table = Table(title="side by side (all tasks)", box=box.SIMPLE_HEAD, title_justify="left")
    table.add_column("")
    for run in runs:
        table.add_column("celery-pglock" if run["lock"] else "stock Celery", justify="right")
    for label, key in COMPARED:
        table.add_row(label, *(str(run["totals"][key]) for run in runs))
    long_parallel = [max(t["max_parallel"] for t in run["tasks"].values()) for run in runs]
    table.add_row("most parallel runs of one task", *map(str, long_parallel))
    console.print(table)


def _beat(run: dict[str, Any]) -> str:
    beat = run["beat"]
    senders = beat["senders"]
    who = (
        f"beat pid {senders[0]}"
        if len(senders) == 1
        else f"beat pids {', '.join(map(str, senders))} in turn (the leader changed)"
    )
    again = beat["slots_sent_again"]
    resent = f" ({again} re-sent after their sender died)" if again else ""
    return (
        f"beat: {beat['slots_sent']} slots sent by {who}{resent}, standby beats sent "
        f"nothing; median delay {_seconds(beat['send_delay_median_s'])} after the due time"
    )


def _reasons(skipped: dict[str, int]) -> str:
    return ", ".join(f"{reason} {count}" for reason, count in skipped.items()) or "-"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f} s"


def _failover(item: dict[str, Any]) -> str:
    if item["failover_s"] is None:
        return f"failover: leader beat pid {item['killed_pid']} killed; no slot sent after it"
    return (
        f"failover: leader beat pid {item['killed_pid']} SIGKILLed; beat pid "
        f"{item['new_leader_pid']} sent the next slot ({item['first_slot_after_kill']}) "
        f"{_seconds(item['failover_s'])} after it was due"
    )


def _freeze(item: dict[str, Any], *, locked: bool) -> str:
    running = ", ".join(item["was_running"]) or "nothing"
    elsewhere = item["long_task_run_elsewhere_after_s"]
    after = (
        "not before the run ended" if elsewhere is None else f"{elsewhere:.1f} s after the freeze"
    )
    fenced = (
        f"{item['stale_writes_rejected']} stale write(s) refused by the fencing token"
        if locked
        else "nothing fences the frozen runs' writes"
    )
    return (
        f"freeze: worker pid {item['frozen_pid']} SIGSTOPped for {item['frozen_for_s']:g} s while "
        f"running {running}; the long task ran on another worker {after}; {fenced}"
    )


def _event(event: dict[str, Any], *, locked: bool) -> str:
    """A line for a fault the failover and freeze lines do not already describe."""
    if event["kind"] == "worker_killed":
        lost = ", ".join(event.get("interrupted_tasks", [])) or "nothing"
        return (
            f"worker pid {event['pid']} SIGKILLed at {event['at_s']:.1f} s (was running {lost}); "
            f"{event.get('replacement', 'a new worker')} started in its place"
        )
    if event["kind"] == "leader_killed" and not locked:
        return (
            f"beat pid {event['pid']} SIGKILLed at {event['at_s']:.1f} s; the other stock beats "
            "kept sending their own copy of every slot"
        )
    return ""


def _redeliveries(run: dict[str, Any]) -> str:
    count = run["redeliveries_injected"]
    ran = run["totals"]["redelivered_executions"]
    return (
        f"{count} message(s) delivered a second time (simulated broker redelivery): "
        f"{ran} ran again, {count - ran} skipped"
    )


def _verdict(run: dict[str, Any]) -> str:
    total = run["totals"]
    doubles, twice = total["double_executions"], total["slots_run_twice"]
    if run["lock"]:
        if doubles:
            return f"[bold red]FAILED: {twice} slot(s) ran more than once with the lock on[/]"
        return "[bold green]OK: no slot ran twice[/]"
    if doubles:
        return f"[bold red]{twice} slot(s) ran more than once: {doubles} extra execution(s)[/]"
    return "no slot ran twice (try more beats)"
