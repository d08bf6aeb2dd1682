"""The demo's pure parts: slots due in a window, the report's arithmetic, its exit status."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from rich.console import Console

from celery_pglock.demo import _cli as cli
from celery_pglock.demo import _render as render
from celery_pglock.demo import _schedule as schedule
from celery_pglock.demo import _server as server
from celery_pglock.demo._chaos import Event, redelivery_headers
from celery_pglock.demo._facts import Execution, Facts, Send, Skip
from celery_pglock.demo._report import full_report, max_parallel, task_stats
from celery_pglock.demo._runner import RunRecord, RunSpec
from celery_pglock.demo._transport import broker_url
from celery_pglock.testing.embedded import EmbeddedPostgresError

EVERY_SECOND = schedule.TASKS_BY_NAME["demo.send_reminders"]  # every 1 s
T0 = 1_800_000_000.0  # a whole second, so slots fall on T0 + 1, T0 + 2, ...


def slot(offset: int) -> str:
    return EVERY_SECOND.slot_of(T0 + offset)


def execution(offset: int, outcome: str = "ok", pid: int = 1, **extra: object) -> Execution:
    values = {
        "task": EVERY_SECOND.name,
        "slot": slot(offset),
        "outcome": outcome,
        "pid": pid,
        "token": None,
        "redelivered": False,
        "started": T0 + offset,
        "finished": T0 + offset + 0.1,
        **extra,
    }
    return Execution(**values)  # type: ignore[arg-type]


def record(locked: bool, executions: list[Execution], skips: list[Skip] | None = None) -> RunRecord:
    spec = RunSpec(locked=locked, beats=2, workers=1, duration=3.0, concurrency=1)
    facts = Facts(executions=executions, skips=skips or [], sends=[])
    window = {"start": T0 + 0.5, "end": T0 + 3.5}
    return RunRecord(spec, "r1", "PostgreSQL", Path("logs"), facts=facts, **window)


def test_slots_between_are_the_boundaries_inside_the_window() -> None:
    """(start, end] holds every epoch-aligned boundary a beat must fire, ends included."""
    assert [slot(1), slot(2), slot(3)] == EVERY_SECOND.slots_between(T0 + 0.5, T0 + 3.0)
    assert [slot(1)] == EVERY_SECOND.slots_between(T0, T0 + 1.0)
    assert [] == EVERY_SECOND.slots_between(T0 + 0.2, T0 + 0.9)


def test_slot_time_inverts_slot_of() -> None:
    """A slot id reads back as the Unix time of its boundary."""
    assert T0 + 2 == schedule.slot_time(slot(2))


def test_task_stats_counts_doubles_skips_and_missed_slots() -> None:
    """Two runs of one slot are one double; a skipped slot is not missed; an empty one is."""
    runs = [execution(1), execution(1, pid=2), execution(2, outcome="stale")]
    skips = [Skip(EVERY_SECOND.name, slot(2), "locked"), Skip(EVERY_SECOND.name, slot(1), "done")]

    stats = task_stats(EVERY_SECOND, record(True, runs, skips))

    assert stats["slots_due"] == 3
    assert (stats["executions"], stats["double_executions"], stats["slots_run_twice"]) == (2, 1, 1)
    assert stats["skipped"] == {"done": 1, "locked": 1}
    assert (stats["missed_slots"], stats["stale_writes_rejected"]) == (1, 1)


def test_max_parallel_ends_a_killed_run_when_its_process_died() -> None:
    """An execution that never finished counts as running until its process was killed."""
    killed = execution(1, outcome="running", pid=7, finished=None)
    later = execution(2, pid=8)

    assert 1 == max_parallel([killed, later], {7: T0 + 1.5}, end=T0 + 10)
    assert 2 == max_parallel([killed, later], {}, end=T0 + 10)


def test_exit_status_is_1_only_for_doubles_under_the_lock() -> None:
    """A slot run twice fails the demo with the lock on, and is the expected show without it."""
    doubled = [execution(1), execution(1, pid=2)]

    assert (1, False) == _status(full_report([record(True, doubled)], seed=1))
    assert (0, True) == _status(full_report([record(False, doubled)], seed=1))
    assert (0, True) == _status(full_report([record(True, doubled[:1])], seed=1))


def _status(report: dict[str, object]) -> tuple[object, object]:
    return report["exit_status"], report["ok"]


def test_failover_is_measured_from_the_beat_send_log() -> None:
    """The first slot due after the kill, sent by the new leader 0.4 s late, is the failover."""
    run = record(True, [execution(1), execution(2)])
    run.events = [Event("leader_killed", T0 + 1.5, "beat-1", [11])]
    run.facts.sends.extend(
        [
            Send("demo.send_reminders", slot(1), "host:11", 1, T0 + 1.02),
            Send("demo.send_reminders", slot(2), "host:12", 1, T0 + 2.4),
        ]
    )

    [failover] = full_report([run], seed=1)["runs"][0]["failover"]

    assert (11, 12, 0.4) == (
        failover["killed_pid"],
        failover["new_leader_pid"],
        pytest.approx(failover["failover_s"]),
    )


def test_redelivery_carries_the_slot_beat_gave_the_message() -> None:
    """A simulated redelivery has the original slot, and a send time inside that slot."""
    headers = redelivery_headers("demo.sync_rates", "2026-11-29T18:05:00Z")

    assert headers["pglock_slot"] == "2026-11-29T18:05:00Z"
    sent_at = headers[schedule.SENT_AT_HEADER]
    assert schedule.TASKS_BY_NAME["demo.sync_rates"].slot_of(sent_at) == "2026-11-29T18:05:00Z"


def test_broker_url_keeps_credentials_and_puts_tables_in_the_schema() -> None:
    """URL and key=value DSNs become a PostgreSQL broker URL whose tables live in the schema."""
    url = broker_url("host=127.0.0.1 port=5433 user=u password=p@ss dbname=app", "demo")

    assert url == (
        "pglock-sqla+postgresql+psycopg://u:p%40ss@127.0.0.1:5433/app?options=-csearch_path%3Ddemo"
    )


def test_demo_says_how_to_use_dsn_when_embedded_postgres_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """No embedded server: exit 2 with the reason and the --dsn way out, nothing started."""

    class Broken:
        def __init__(self) -> None:
            raise EmbeddedPostgresError("no PostgreSQL server binaries found")

    monkeypatch.setattr(server, "EmbeddedPostgres", Broken)

    assert 2 == cli.main(["--duration", "3"])
    err = capsys.readouterr().err
    assert "no PostgreSQL server binaries found" in err
    assert "--dsn postgresql://" in err


def test_chaos_needs_a_long_enough_run(capsys: pytest.CaptureFixture[str]) -> None:
    """--chaos spreads three faults over the run: a too short run is refused up front."""
    assert 2 == cli.main(["--chaos", "--duration", "5"])
    assert "--chaos needs --duration" in capsys.readouterr().err


def test_text_report_shows_both_runs_faults_and_the_verdicts() -> None:
    """The text report renders a table per run, the faults, and a side-by-side table."""
    locked = record(True, [execution(1), execution(2), execution(3, outcome="stale", pid=9)])
    locked.events = [Event("worker_frozen", T0 + 2.5, "worker-1", [9], {"frozen_for_s": 5.0})]
    stock = record(False, [execution(1), execution(1, pid=2), execution(2), execution(3)])
    report = full_report([stock, locked], seed=5)
    out = io.StringIO()
    console = Console(file=out, width=render.WIDTH, color_system=None)

    for run in report["runs"]:
        render.print_run(console, run)
    render.print_comparison(console, report["runs"])

    text = out.getvalue()
    assert "1 slot(s) ran more than once: 1 extra execution(s)" in text
    assert "OK: no slot ran twice" in text
    assert "freeze: worker pid 9 SIGSTOPped for 5 s" in text
    assert "stock Celery   celery-pglock" in text
