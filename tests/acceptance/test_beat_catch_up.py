"""Every beat replica down across several slots, then back: which missed slots are sent.

One scenario per ``pglock_beat_catch_up`` policy (own schema, namespace, queue, worker and
beat), all run side by side on one timeline: a 1-s interval entry ticks, every beat is
stopped for about five slots, then a beat starts again. The slots between the last one
sent before the outage and the first one due after it are the *missed* slots.

With a 1-s entry the newest slot is never older than the grace when the beat comes back,
so ``latest`` sends just it, as ``none`` does; the difference (an entry whose newest slot
is older than the grace) is in ``tests/unit/test_policies.py``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pytest

from celery_pglock._slots import format_slot
from tests.acceptance.beat_support import (
    APP,
    Scenario,
    Send,
    Spec,
    prepare_schema,
    slot_epoch,
    stop_together,
)
from tests.apps.harness import app_env
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

POLICIES = {"none": ("none", 10), "latest": ("latest", 10), "all": ("all", 10), "all_2": ("all", 2)}
WARM_SENDS = 3  # slots sent before the outage
OUTAGE = 5.0  # seconds without any beat
AFTER_SENDS = 3  # slots claimed after the restart
DEADLINE = 60.0


@dataclass
class Outage:
    """One policy's scenario, and what the outage looked like in it."""

    scenario: Scenario
    last_before: str = ""  # the newest slot sent before the outage
    restarted_at: float = 0.0  # epoch seconds

    def after(self) -> list[Send]:
        """Claims made since the restart, in slot order."""
        return [s for s in self.scenario.sends() if s.claimed_at.timestamp() >= self.restarted_at]

    def first_batch(self) -> list[Send]:
        """The claims of the restarted beat's first sending tick."""
        after = self.after()
        first = min(send.claimed_at for send in after)
        return [send for send in after if send.claimed_at == first]

    def resumed(self) -> str:
        """The slot current when sending resumed: the newest of the first batch."""
        return max(send.slot for send in self.first_batch())

    def missed(self) -> list[str]:
        """The 1-s slots after the last one sent before the outage and before ``resumed``."""
        start, end = slot_epoch(self.last_before) + 1, slot_epoch(self.resumed())
        return [format_slot(datetime.fromtimestamp(s, timezone.utc)) for s in range(start, end)]

    def sent(self) -> set[str]:
        return {send.slot for send in self.scenario.sends()}


def start(scenario: Scenario, *, worker: bool) -> None:
    """Start a beat for ``scenario`` (and a solo worker)."""
    env, procs = scenario.env, scenario.procs
    if worker:
        scenario.workers.append(
            procs.celery(
                APP,
                "worker",
                "--pool=solo",
                "--loglevel=INFO",
                f"--hostname=w-{scenario.name}-{uuid.uuid4().hex[:6]}@%h",
                "--without-mingle",
                "--without-gossip",
                "--without-heartbeat",
                env=env,
                name="worker",
            )
        )
    scenario.beats.append(procs.celery(APP, "beat", "--loglevel=INFO", env=env, name="beat"))


def make_scenario(name: str, dsn: str, redis_url: str, root: Path) -> Scenario:
    """A scenario of its own schema, namespace and queue, for one catch-up policy."""
    policy, limit = POLICIES[name]
    schema = f"t_{uuid.uuid4().hex[:12]}"
    env = app_env(
        pg_dsn=dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_NAMESPACE=f"catchup-{name}-{uuid.uuid4().hex[:8]}",
        TEST_BEAT_EVERY="1",
        TEST_BEAT_CATCH_UP=policy,
        TEST_BEAT_CATCH_UP_LIMIT=limit,
    )
    (root / name).mkdir()
    prepare_schema(dsn, schema)
    return Scenario(name, Spec(beats=1), dsn, env, Procs(root / name, cwd=Path.cwd()))


def wait_all(outages: dict[str, Outage], enough: str, predicate: Callable[[Outage], bool]) -> None:
    """Wait until ``predicate`` holds in every scenario (failing at once if a process died)."""
    for outage in outages.values():
        wait_until(
            lambda o=outage: o.scenario.check_alive() or predicate(o),  # type: ignore[misc]
            timeout=DEADLINE,
            interval=0.2,
            message=f"{enough} ({outage.scenario.name})",
        )


def stop_beats(outages: dict[str, Outage]) -> None:
    """Stop every beat together; note the last slot each scenario sent."""
    for outage in outages.values():
        for beat in outage.scenario.beats:
            beat.terminate()
    for outage in outages.values():
        for beat in outage.scenario.beats:
            beat.stop()
        outage.scenario.beats.clear()  # stopped on purpose: check_alive must not mind
        outage.last_before = max(send.slot for send in outage.scenario.sends())


def run_outage(outages: dict[str, Outage]) -> None:
    """Warm up, stop every beat for OUTAGE seconds, restart, let a few slots go by."""
    wait_all(outages, "warm-up sends", lambda o: len(o.scenario.sends()) >= WARM_SENDS)
    stop_beats(outages)
    stopped_at = datetime.now().timestamp()
    wait_until(
        lambda: datetime.now().timestamp() >= stopped_at + OUTAGE,  # the fault's length
        timeout=OUTAGE + 1,
        interval=0.1,
        message="the outage to last",
    )
    for outage in outages.values():
        outage.restarted_at = datetime.now().timestamp()
        start(outage.scenario, worker=False)
    wait_all(outages, "sends after restart", lambda o: len(o.after()) >= AFTER_SENDS)
    wait_all(outages, "their runs", lambda o: o.after()[-1].slot in o.scenario.executed_slots())


@pytest.fixture(scope="module")
def outages(
    pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Outage]]:
    """Every policy's scenario, through one outage on a shared timeline."""
    root = tmp_path_factory.mktemp("catch_up")
    found: dict[str, Outage] = {}
    try:
        for name in POLICIES:
            found[name] = Outage(make_scenario(name, pg_dsn, redis_url, root))
            start(found[name].scenario, worker=True)
        run_outage(found)
        yield found
    finally:
        for outage in found.values():
            with contextlib.suppress(Exception):
                stop_together(outage.scenario.procs)
            drop_schema(pg_dsn, outage.scenario.schema)


@pytest.fixture
def outage(
    request: pytest.FixtureRequest, outages: dict[str, Outage], procs: Procs
) -> Iterator[Outage]:
    """The parametrized policy's scenario; its processes' logs go in a failure's report."""
    found = outages[request.param]
    lent = found.scenario.procs.started
    procs.started.extend(lent)
    try:
        yield found
    finally:
        procs.started[:] = [proc for proc in procs.started if proc not in lent]


@pytest.mark.parametrize("outage", ["none", "latest", "all", "all_2"], indirect=True)
def test_outage_spans_several_slots(outage: Outage) -> None:
    """The scenario is what the tests below read: at least 3 slots fell due unsent."""
    assert len(outage.missed()) >= 3


@pytest.mark.parametrize("outage", ["none", "latest"], indirect=True)
def test_missed_slots_are_not_sent(outage: Outage) -> None:
    """'none' and (with a 1-s entry) 'latest': no missed slot is ever sent."""
    assert set() == outage.sent() & set(outage.missed())


@pytest.mark.parametrize("outage", ["none", "latest"], indirect=True)
def test_sending_resumes_with_the_current_slot(outage: Outage) -> None:
    """'none'/'latest': the first tick after the restart sends the current slot alone."""
    assert [outage.resumed()] == [send.slot for send in outage.first_batch()]


def caught_up(outage: Outage, limit: int) -> list[str]:
    """The missed slots that go out with the current one: the newest ``limit - 1``. On a
    busy machine the beat may take seconds to start again, and the outage outgrow the
    limit (10 slots missed once in make test, the oldest then rightly not sent)."""
    return outage.missed()[-(limit - 1) :]


def test_catch_up_all_sends_every_missed_slot_at_once(outages: dict[str, Outage]) -> None:
    """'all': the missed slots (the newest, up to the limit) go out with the current one,
    in the first tick back."""
    outage = outages["all"]
    caught = caught_up(outage, POLICIES["all"][1])

    assert [*caught, outage.resumed()] == [s.slot for s in outage.first_batch()]


def test_catch_up_all_runs_every_slot_once(outages: dict[str, Outage]) -> None:
    """'all': with the caught-up slots, every slot from start to end ran exactly once."""
    outage = outages["all"]
    ran = outage.scenario.executed_slots()

    assert sorted(set(ran)) == sorted(ran)
    assert set(caught_up(outage, POLICIES["all"][1])) <= set(ran)


def test_catch_up_all_sends_at_most_the_limit(outages: dict[str, Outage]) -> None:
    """'all' with limit 2: only the newest missed slot goes out with the current one."""
    outage = outages["all_2"]

    caught = caught_up(outage, POLICIES["all_2"][1])
    assert [*caught, outage.resumed()] == [s.slot for s in outage.first_batch()]
    assert set() == outage.sent() & set(outage.missed()[:-1])
