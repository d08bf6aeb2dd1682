"""Beat's claims without PostgreSQL: ``BeatClaims`` through its ``RunQuery`` seam, with the
statements it sends recorded and their rows given (as procrastinate tests its manager).

What the statements do to the tables is the integration and acceptance tiers' matter;
here, what beat asks for, in which order, and how it reads the answers.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Iterator
from datetime import datetime, timezone
from types import SimpleNamespace
from typing import Any

import pytest
from celery import Celery

from celery_pglock._keys import lock_key
from celery_pglock.beat._claims import RESEND_LIMIT, BeatClaims
from celery_pglock.beat._planner import Due
from celery_pglock.beat._sending import CONFIRM_BATCH, Confirmations, HeldStops, batched
from celery_pglock.beat._settings import BeatSettings
from celery_pglock.errors import DatabaseUnavailable, SessionGone

SLOT_A, SLOT_B = "2026-11-29T18:05:00Z", "2026-11-29T18:05:10Z"


class Recorder:
    """A ``RunQuery`` that records each statement and answers with the rows given."""

    def __init__(self, **rows: list[dict[str, Any]]) -> None:
        self.rows = rows
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        self.calls.append((name, params))
        return self.rows.get(name, [])

    def params(self, name: str) -> dict[str, Any]:
        [found] = [params for called, params in self.calls if called == name]
        return found


def claim_row(entry: str, slot: str, paused: bool) -> dict[str, Any]:
    """A ``beat_claim`` row."""
    return {"entry": entry, "slot": slot, "paused": paused}


def state(entry: str, last_slot: str | None, count: int) -> dict[str, Any]:
    """A ``beat_state`` row."""
    return {"entry": entry, "last_slot": last_slot, "last_run_at": None, "total_run_count": count}


@pytest.fixture
def settings() -> BeatSettings:
    app = Celery("claims", set_as_current=False)
    app.conf.update(pglock_dsn="postgresql://nobody@localhost/none", pglock_namespace="ns")
    return BeatSettings.from_app(app)


def due(entry: str, slot: str) -> Due:
    return Due(SimpleNamespace(name=entry, task=f"proj.{entry}"), slot, f"ns:proj.{entry}")


def test_claims_go_in_entry_and_slot_order_whatever_the_schedule_s_order(
    settings: BeatSettings,
) -> None:
    """Two replicas holding the entries in other orders claim in one order: no deadlock."""
    run = Recorder()

    BeatClaims(settings, run).claim([due("b", SLOT_B), due("a", SLOT_B), due("a", SLOT_A)])

    params = run.params("beat_claim")
    assert ["a", "a", "b"] == params["entries"]
    assert [SLOT_A, SLOT_B, SLOT_B] == params["slots"]
    assert [lock_key(name) for name in params["lock_names"]] == params["keys"]
    assert (settings.namespace, settings.replica) == (params["namespace"], params["replica"])


def test_only_what_this_replica_claimed_is_sent_and_a_paused_claim_is_not(
    settings: BeatSettings,
) -> None:
    """The statement returns what this replica claimed: unpaused ones to send, paused
    ones recorded only; a slot another replica claimed comes back in neither."""
    run = Recorder(beat_claim=[claim_row("a", SLOT_A, False), claim_row("b", SLOT_A, True)])

    claimed = BeatClaims(settings, run).claim([due(e, SLOT_A) for e in ("a", "b", "c")])

    assert ({("a", SLOT_A)}, {("b", SLOT_A)}) == (claimed.send, claimed.paused)


class Deadlocking(Recorder):
    """The first ``times`` claims end in a deadlock with another replica's claim, as
    PostgreSQL answers one of two such statements (chaos seed 47303, active-active: two
    in a campaign, each logged as "beat cannot reach PostgreSQL")."""

    def __init__(self, times: int, **rows: list[dict[str, Any]]) -> None:
        super().__init__(**rows)
        self.times = times

    def __call__(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        if name == "beat_claim" and self.times:
            self.times -= 1
            self.calls.append((name, params))
            # As the store names it: an OperationalError, so "the session ended".
            deadlock = SessionGone("the session with PostgreSQL ended: deadlock detected")
            deadlock.sqlstate = "40P01"
            raise deadlock
        return super().__call__(name, params)


def test_a_claim_that_deadlocked_with_another_replica_s_is_made_again(
    settings: BeatSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """PostgreSQL rolls one of two deadlocked claims back whole: claimed again at once,
    it takes what the other left, and no ERROR says PostgreSQL is unreachable."""
    run = Deadlocking(1, beat_claim=[claim_row("a", SLOT_A, False)])

    with caplog.at_level(logging.INFO, logger="celery_pglock.beat"):
        claimed = BeatClaims(settings, run).claim([due("a", SLOT_A), due("b", SLOT_A)])

    assert {("a", SLOT_A)} == claimed.send
    assert ["beat_claim", "beat_claim"] == [name for name, _ in run.calls]
    assert [] == [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any(getattr(r, "action", None) == "pglock_beat_claim_deadlock" for r in caplog.records)


def test_a_claim_that_deadlocks_again_fails_as_before(settings: BeatSettings) -> None:
    """Twice in a row: the error goes up (the tick is left to the other replicas)."""
    run = Deadlocking(2)

    with pytest.raises(SessionGone):
        BeatClaims(settings, run).claim([due("a", SLOT_A)])


def test_confirm_records_the_sent_claims_in_order_with_their_times(
    settings: BeatSettings,
) -> None:
    """Confirmed in the claims' order (rows locked alike by every replica), each slot's
    nominal time as the entry's last run; nothing sent, nothing asked."""
    run = Recorder()
    claims = BeatClaims(settings, run)

    claims.confirm([])
    claims.confirm([due("b", SLOT_A), due("a", SLOT_B)])

    [(name, params)] = run.calls
    assert ("beat_confirm", ["a", "b"]) == (name, params["entries"])
    expected = [datetime(2026, 11, 29, 18, 5, s, tzinfo=timezone.utc) for s in (10, 0)]
    assert expected == params["run_ats"]


def test_unconfirmed_claims_are_read_after_the_resend_delay(settings: BeatSettings) -> None:
    """Claims never confirmed are taken over by this replica after pglock_beat_resend_after."""
    run = Recorder(beat_unsent=[{"entry": "a", "slot": SLOT_A}])

    found = BeatClaims(settings, run).unconfirmed()

    params = run.params("beat_unsent")
    assert [("a", SLOT_A)] == found
    assert (settings.replica, settings.resend_after) == (params["replica"], params["after"])


def test_the_last_slots_sent_skip_entries_never_sent(settings: BeatSettings) -> None:
    """A new leader goes on from the stored slots; an entry with none starts afresh."""
    run = Recorder(beat_state=[state("a", SLOT_A, 1), state("b", None, 0)])

    assert {"a": SLOT_A} == BeatClaims(settings, run).last_slots_sent()


def test_the_orphan_sweep_reports_each_row_it_recorded_failed(
    settings: BeatSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """Rows whose attempt died are named in one WARNING each, with their token."""
    row = {"lock_name": "ns:proj.a", "slot": SLOT_A, "token": 7}
    row |= {"task_id": "task-1", "host": "host-1", "pid": 42}
    run = Recorder(abandon_orphans=[row])

    with caplog.at_level(logging.WARNING, logger="celery_pglock"):
        BeatClaims(settings, run).sweep_orphans()

    [record] = caplog.records
    assert "abandon_orphans" == run.calls[0][0]
    assert "token 7" in record.getMessage()


def test_a_new_leader_takes_over_every_unconfirmed_claim_at_once(settings: BeatSettings) -> None:
    """Whoever claimed them no longer leads: no wait for pglock_beat_resend_after, and a
    whole batch per statement (not 100 a tick)."""
    run = Recorder(beat_unsent=[{"entry": "a", "slot": SLOT_A}])

    BeatClaims(settings, run).unconfirmed(at_once=True)

    params = run.params("beat_unsent")
    assert (0.0, RESEND_LIMIT) == (params["after"], params["limit"])


def test_sends_are_confirmed_in_batches_as_they_go_and_the_rest_at_the_end(
    settings: BeatSettings,
) -> None:
    """Every CONFIRM_BATCH messages one confirmation, then one for the remainder; paused
    claims ride with the first."""
    run = Recorder()
    confirmations = Confirmations(BeatClaims(settings, run), [due("p", SLOT_A)])

    for n in range(2 * CONFIRM_BATCH + 5):
        confirmations.sent(due(f"e{n:04d}", SLOT_A))
    confirmations.flush()

    sizes = [len(params["entries"]) for name, params in run.calls if name == "beat_confirm"]
    assert 2 * CONFIRM_BATCH + 6 == sum(sizes) == confirmations.confirmed
    assert max(sizes) <= CONFIRM_BATCH, sizes
    assert len(sizes) >= 3, sizes


def test_a_stop_mid_tick_confirms_what_went_out_and_says_so_when_it_cannot(
    settings: BeatSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM mid-tick: what was sent is confirmed; if PostgreSQL refuses, one WARNING
    says how many are left to the next leader, and the stop goes on (no new error)."""
    run = Recorder()
    confirmations = Confirmations(BeatClaims(settings, run))
    confirmations.sent(due("a", SLOT_A))

    confirmations.flush_on_stop(SystemExit())

    assert ["a"] == run.params("beat_confirm")["entries"]

    def refuse(name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        raise DatabaseUnavailable("gone")

    confirmations = Confirmations(BeatClaims(settings, refuse))
    confirmations.sent(due("b", SLOT_A))
    with caplog.at_level(logging.WARNING, logger="celery_pglock"):
        confirmations.flush_on_stop(SystemExit())

    [record] = caplog.records
    assert "1 sent message(s) left unconfirmed" in record.getMessage()


class BatchingProducer:
    """A producer with kombu's ``batch()`` (as on Redis): records when batches reach the
    broker; ``fail`` is raised by the flush that finds something buffered."""

    def __init__(self, run: Recorder, fail: BaseException | None = None) -> None:
        self.run, self.fail, self.buffered, self.flushes = run, fail, 0, 0
        self.max_size, self.failed = 0, False

    def batch(self, max_size: int) -> BatchingProducer:
        self.max_size = max_size
        return self

    def __enter__(self) -> BatchingProducer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.flush()

    def publish(self) -> None:
        self.buffered += 1

    def flush(self) -> None:
        if self.failed or (self.buffered and self.fail is not None):
            self.buffered, self.failed = 0, True  # as kombu: a failed batch fails again
            raise self.fail or RuntimeError("unreachable")
        if self.buffered:
            self.run.calls.append(("broker", {"messages": self.buffered}))
            self.flushes += 1
        self.buffered = 0


def send_in_batch(producer: Any, confirmations: Confirmations, count: int) -> None:
    with batched(producer, confirmations):
        for n in range(count):
            producer.publish()
            confirmations.sent(due(f"e{n:04d}", SLOT_A))


def test_a_batch_reaches_the_broker_before_its_claims_are_confirmed(
    settings: BeatSettings,
) -> None:
    """With kombu's batches each confirmation comes right after its messages reached the
    broker, never before; the paused claims ride with the first."""
    run = Recorder()
    producer = BatchingProducer(run)
    confirmations = Confirmations(BeatClaims(settings, run), [due("p", SLOT_A)])

    send_in_batch(producer, confirmations, 2 * CONFIRM_BATCH + 5)
    confirmations.flush()

    order = [name for name, _ in run.calls]
    assert order[::2] == ["broker"] * (len(order) // 2), order
    assert order[1::2] == ["beat_confirm"] * (len(order) // 2), order
    assert 2 * CONFIRM_BATCH + 6 == confirmations.confirmed
    assert producer.max_size >= CONFIRM_BATCH


def test_a_batch_the_broker_refused_is_never_confirmed(
    settings: BeatSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker fails the batch: its claims stay unconfirmed (re-sent later), one ERROR
    says how many, beat goes on; a paused claim is still recorded."""
    run = Recorder()
    producer = BatchingProducer(run, fail=ConnectionError("broker gone"))
    confirmations = Confirmations(BeatClaims(settings, run), [due("p", SLOT_A)])

    with caplog.at_level(logging.ERROR, logger="celery_pglock.beat"):
        send_in_batch(producer, confirmations, 3)
        confirmations.flush()

    assert ["p"] == run.params("beat_confirm")["entries"]
    [record] = caplog.records
    assert "could not send 3 message(s)" in record.getMessage()


def test_a_stop_raised_inside_a_batch_s_flush_leaves_its_claims_unconfirmed_and_says_so(
    settings: BeatSettings, caplog: pytest.LogCaptureFixture
) -> None:
    """A stop raised inside the flush itself (a further stop, delivered at once: delivery
    uncertain): none of the batch's claims is confirmed, the next leader re-sends them,
    and one WARNING says how many."""
    run = Recorder()
    producer = BatchingProducer(run, fail=SystemExit())
    confirmations = Confirmations(BeatClaims(settings, run))

    with caplog.at_level(logging.WARNING, logger="celery_pglock.beat"), pytest.raises(SystemExit):
        send_in_batch(producer, confirmations, 3)
    confirmations.flush_on_stop(SystemExit())

    assert [] == [name for name, _ in run.calls if name == "beat_confirm"]
    [record] = caplog.records
    assert "3 sent message(s) left unconfirmed" in record.getMessage()
    assert "pglock_beat_unconfirmed" == record.action  # type: ignore[attr-defined]


class Stopped(BaseException):
    """What the stand-in for Celery's beat handler raises (its SystemExit)."""


@pytest.fixture
def stop_handler() -> Iterator[list[str]]:
    """SIGTERM handled as ``celery beat`` does (raise), for the test; each call noted."""
    calls: list[str] = []

    def stop(signum: int, frame: object) -> None:
        calls.append("stop")
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, previous)


class SignalledProducer(BatchingProducer):
    """A producer whose flush gets ``signals`` SIGTERMs while its batch goes out."""

    def __init__(self, run: Recorder, signals: int) -> None:
        super().__init__(run)
        self.signals = signals

    def flush(self) -> None:
        if self.buffered and self.signals:
            signals, self.signals = self.signals, 0
            self.run.calls.append(("signalled", {}))
            for _ in range(signals):
                os.kill(os.getpid(), signal.SIGTERM)
        super().flush()


def test_a_stop_while_a_batch_goes_out_waits_until_it_is_on_the_broker_and_confirmed(
    settings: BeatSettings, stop_handler: list[str]
) -> None:
    """SIGTERM in the middle of a batch's flush (issue 34): the batch reaches the broker
    and its claims are confirmed, then the stop's own handler runs, once."""
    run = Recorder()
    confirmations = Confirmations(BeatClaims(settings, run))

    with pytest.raises(Stopped):
        send_in_batch(SignalledProducer(run, signals=1), confirmations, CONFIRM_BATCH + 5)

    assert ["signalled", "broker", "beat_confirm"] == [name for name, _ in run.calls]
    assert CONFIRM_BATCH == confirmations.confirmed
    assert ["stop"] == stop_handler
    assert signal.getsignal(signal.SIGTERM) is not None  # put back
    assert not isinstance(signal.getsignal(signal.SIGTERM), HeldStops)


def test_a_further_stop_while_one_is_held_is_taken_at_once(
    settings: BeatSettings, stop_handler: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    """Two SIGTERMs while a batch goes out: the second is not held (beat stuck on the
    broker can still be stopped); the batch stays unconfirmed, and a WARNING says so."""
    run = Recorder()
    confirmations = Confirmations(BeatClaims(settings, run))

    with caplog.at_level(logging.WARNING, logger="celery_pglock.beat"), pytest.raises(Stopped):
        send_in_batch(SignalledProducer(run, signals=2), confirmations, 3)

    assert [] == [name for name, _ in run.calls if name == "beat_confirm"]
    assert ["stop"] == stop_handler
    assert ["3 sent message(s) left unconfirmed"] == [
        r.getMessage().split("; ")[1] for r in caplog.records
    ]


def test_without_batches_each_message_goes_out_as_it_is_published(
    settings: BeatSettings,
) -> None:
    """RabbitMQ, or a kombu before 5.7: no batch(); confirmations as before."""
    run = Recorder()
    confirmations = Confirmations(BeatClaims(settings, run))

    send_in_batch(SimpleNamespace(publish=lambda: None), confirmations, 3)
    confirmations.flush()

    assert 3 == len(run.params("beat_confirm")["entries"])
