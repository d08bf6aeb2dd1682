"""``celery -A … pglock backfill|rerun|schedule`` against real processes, on the controls
lab (``controls_lab``: two active-active beat replicas and a worker serving ``tick``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.acceptance.controls_lab import Lab, held_back

pytestmark = pytest.mark.acceptance


@pytest.fixture
def lab(controls_lab: Lab) -> Lab:
    return controls_lab


def test_backfill_sends_only_the_slots_that_did_not_succeed(lab: Lab) -> None:
    gap = held_back(lab, 2)
    before = [slot for slot in lab.executed() if slot < gap[0]][-2:]
    span = ("--from", before[0], "--to", gap[-1])

    code, out = lab.cli("backfill", "tick", *span, "--dry-run", "--json")
    assert 0 == code, out
    planned = {p["slot"]: p["action"] for p in json.loads(out)["slots"]}
    assert all(planned[slot] == "skip" for slot in before)
    assert all(planned[slot] == "send" for slot in gap)
    assert not set(gap) & set(lab.executed())  # a dry run sends nothing

    code, out = lab.cli("backfill", "tick", *span, "--rate", "20", "--json")

    assert 0 == code, out
    sent = {p["slot"]: p.get("outcome") for p in json.loads(out)["slots"] if p["action"] == "send"}
    assert dict.fromkeys(gap, "succeeded") == {slot: sent[slot] for slot in gap}
    executed = lab.executed()
    assert [1] * len(before + gap) == [executed.count(slot) for slot in before + gap]


def test_a_backfill_is_audited_before_its_first_slot_is_sent(lab: Lab) -> None:
    """The audit row of a backfill is written before any of its slots runs (as the
    dashboard's): a backfill stopped half-way leaves its trail."""
    gap = held_back(lab, 1)

    code, out = lab.cli("backfill", "tick", "--from", gap[0], "--to", gap[-1], "--json")

    assert 0 == code, out
    backfills = lab.rows("SELECT * FROM {} WHERE action = 'backfill'", "pglock_audit")
    [audit] = [row for row in backfills if gap[0] in row["detail"]["sent"]]
    [run] = [r for r in lab.runs() if r["slot"] == gap[0]]
    assert audit["at"] < run["started_at"]


def test_rerun_runs_a_succeeded_slot_once_more_with_a_larger_token(lab: Lab) -> None:
    slot = lab.executed()[1]
    [row] = [r for r in lab.runs() if r["slot"] == slot]

    code, out = lab.cli("rerun", "tick", slot, "--reason", "customer asked", "--json")

    assert 0 == code, out
    done = json.loads(out)
    assert ("succeeded", row["token"]) == (done["outcome"], done["previous"]["token"])
    assert done["token"] > row["token"]
    assert 2 == lab.executed().count(slot)
    [audit] = lab.rows(
        "SELECT * FROM {} WHERE action = 'rerun' AND slot = %(s)s", "pglock_audit", s=slot
    )
    assert ("customer asked", row["token"]) == (
        audit["reason"],
        audit["detail"]["previous"]["token"],
    )


def test_schedule_flags_what_both_dst_switches_do(lab: Lab) -> None:
    env = lab.env
    argv = [sys.executable, "-m", "celery", "-A", "tests.apps.dstapp", "pglock", "schedule"]

    def preview(start: str, entry: str) -> str:
        args = ["--from", start, "--entry", entry, "--next", "2"]
        done = subprocess.run([*argv, *args], env=env, capture_output=True, text=True, check=False)
        assert 0 == done.returncode, done.stdout + done.stderr
        return done.stdout

    spring = preview("2027-03-27T12:00:00Z", "nightly")
    assert "2027-03-28T01:30:00Z  2027-03-28 03:30:00 CEST" in spring
    assert "02:30 does not exist this day; fires at 03:30 CEST" in spring
    autumn = preview("2027-10-30T12:00:00Z", "nightly")
    assert "2027-10-31T00:30:00Z" in autumn
    assert "02:30 happens twice this day; runs once, the first" in autumn
    quarter = preview("2027-03-28T00:50:00Z", "quarter-hours")
    assert "02:00, 02:15, 02:30, 02:45 do not exist this day; not run" in quarter
    hourly = preview("2027-03-28T00:00:00Z", "hourly")
    assert "DST" not in hourly  # intervals run on UTC boundaries
