"""Bad lock names and slots through a real worker: a clear FAILURE, never a silent drop.

``faults.raw`` takes its lock name and slot from its arguments as given (its ``pglock_key``
and ``pglock_slot`` functions return them, or raise when asked to). One worker, one batch
of messages: unicode, the largest accepted sizes, NUL bytes, 10 kB strings, functions that
raise or return something other than a string.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.apps import testapp
from tests.faults.workload import Invariants, Report, Sent, Workload
from tests.fixtures.procs import Procs

pytestmark = pytest.mark.faults

SLOT = "2026-11-29T18:05:00Z"
TEN_KB = "x" * 10_240


def cases(ns: str) -> dict[str, tuple[Any, Any, str]]:
    """name -> (key, slot, what the error must say); an empty text: it must succeed."""
    largest = f"{ns}:" + secrets.token_hex(512)[: 1024 - len(ns) - 1]
    return {
        "unicode": (f"{ns}:ünïcødé-🔒-名前", "2026-11-29/日本語-✓", ""),
        # Random hex does not compress: the index entry really is this long.
        "largest": (largest, secrets.token_hex(512), ""),
        "nul-key": (f"{ns}:a\x00b", SLOT, "NUL"),
        "nul-slot": (f"{ns}:nul-slot", "a\x00b", "NUL"),
        "10kb-key": (f"{ns}:{TEN_KB}", SLOT, "at most 1024 bytes"),
        "10kb-slot": (f"{ns}:10kb-slot", TEN_KB, "at most 1024 bytes"),
        "key-raises": ({"raise": "no key for you"}, SLOT, "pglock_key function raised ValueError"),
        "slot-raises": (f"{ns}:slot-raises", {"raise": "no slot"}, "pglock_slot function raised"),
        "key-not-str": (42, SLOT, "must be a str"),
        "slot-not-str": (f"{ns}:slot-not-str", 20261129, "a slot must be a str"),
    }


EXPECTED = {name: says for name, (_, _, says) in cases("ns").items()}


@dataclass
class Run:
    workload: Workload
    sent: dict[str, list[Sent]] = field(default_factory=dict)
    report: Report = field(default_factory=Report)

    @property
    def procs(self) -> Procs:
        return self.workload.procs


@pytest.fixture(scope="module")
def run(pg_dsn: str, redis_url: str, run_procs: Procs) -> Any:
    """One worker, every case sent twice, the checker."""
    w = Workload(
        name="badinput", admin_dsn=pg_dsn, app_dsn=pg_dsn, redis_url=redis_url, procs=run_procs
    )
    result = Run(w)
    try:
        w.prepare()
        w.worker()
        for name, (key, slot, _) in cases(w.namespace).items():
            kwargs = {"key": key, "slot": slot}
            result.sent[name] = [
                Sent(testapp.app.send_task("faults.raw", kwargs=kwargs), str(key), str(slot))
                for _ in range(2)
            ]
            w.sent.extend(result.sent[name])
        w.settle(w.sent)
        w.stop()
        result.report = w.check()
        yield result
    finally:
        w.drop()


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""


@pytest.mark.parametrize("case", ["unicode", "largest"])
def test_valid_extremes_run_once_and_are_stored_exactly(run: Run, case: str) -> None:
    """Unicode, and a 1 kB lock name with a 1 kB slot, run once and land in the ledger as sent."""
    sent = run.sent[case]
    key, slot = sent[0].lock, sent[0].slot
    [row] = [r for r in run.workload.ledger() if r["lock_name"] == key]
    assert ["SKIPPED", "SUCCESS"] == sorted(s.result.state for s in sent)
    assert (slot, "succeeded") == (row["slot"], row["state"])


@pytest.mark.parametrize(
    "case",
    [
        "nul-key",
        "nul-slot",
        "10kb-key",
        "10kb-slot",
        "key-raises",
        "slot-raises",
        "key-not-str",
        "slot-not-str",
    ],
)
def test_bad_input_fails_the_task_naming_the_problem(run: Run, case: str) -> None:
    """Each message fails (not retried, not dropped) with a ConfigurationError saying why."""
    says = EXPECTED[case]
    errors = [s.result.result for s in run.sent[case]]
    assert ["FAILURE", "FAILURE"] == [s.result.state for s in run.sent[case]]
    assert [("ConfigurationError", True)] * 2 == [
        (type(e).__name__, says in str(e)) for e in errors
    ]


def test_refused_messages_neither_ran_nor_claimed(run: Run) -> None:
    """A message refused for bad input left no execution and no ledger row behind."""
    ran = {r["lock_name"] for r in run.workload.executions()}
    claimed = {r["lock_name"] for r in run.workload.ledger()}
    sent = {s.lock for name, group in run.sent.items() for s in group}
    valid = {run.sent[name][0].lock for name in ("unicode", "largest")}
    assert (valid, valid) == (ran & sent, claimed & sent)
