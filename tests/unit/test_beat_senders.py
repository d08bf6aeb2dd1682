"""A large tick shared among forked sender processes (``pglock_beat_senders``).

Real forks and pipes; the broker and the ledger are replaced (a publish that only
counts, confirmations recorded in memory): tests/integration/test_beat_senders.py and the
acceptance tests send through Redis and confirm in PostgreSQL.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from celery_pglock._values import senders_option
from celery_pglock.beat import _senders as senders_module
from celery_pglock.beat._planner import Due
from celery_pglock.beat._senders import Sending, send_shared
from celery_pglock.beat._sending import CONFIRM_BATCH, Confirmations, HeldStops
from celery_pglock.errors import ConfigurationError, SessionGone
from tests.fixtures.procs import children_of

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="senders are forked")

SLOT = "2026-12-07T17:00:00Z"
CLAIMS = 4 * CONFIRM_BATCH


class Ledger:
    """Confirmations, in memory: the batches confirmed, in order."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def confirm(self, sent: Iterable[Due]) -> None:
        self.batches.append([item.entry.name for item in sent])

    def confirmed(self) -> list[str]:
        return [name for batch in self.batches for name in batch]


class Stopped(BaseException):
    """What the stand-in for Celery's beat handler raises (its SystemExit)."""


def claims(count: int = CLAIMS) -> list[Due]:
    return [Due(SimpleNamespace(name=f"e{n:05d}"), SLOT, f"ns:e{n:05d}") for n in range(count)]


def sending(
    publish: Callable[[Due, Any], bool] = lambda item, producer: True,
    still_leading: Callable[[float], bool] = lambda checked_at: True,
) -> Sending:
    return Sending(
        publish=publish,
        new_producer=SimpleNamespace,  # no batch(): each message out as published
        still_leading=still_leading,
        lease=5.0,
    )


def children() -> set[int]:
    return children_of(os.getpid())


@pytest.fixture
def stop_handler() -> Iterator[None]:
    """SIGTERM handled as ``celery beat`` does (raise), for the test."""

    def stop(signum: int, frame: object) -> None:
        raise Stopped

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def share(ledger: Ledger, items: list[Due], how: Sending, senders: int = 2) -> list[Due]:
    with HeldStops() as stops:
        return send_shared(items, senders, how, Confirmations(ledger), stops)


def test_every_claim_is_sent_by_one_sender_and_confirmed_once_in_batches() -> None:
    ledger = Ledger()
    items = claims()

    left = share(ledger, items, sending(), senders=3)

    assert [] == left
    assert sorted(item.entry.name for item in items) == sorted(ledger.confirmed())
    assert max(len(batch) for batch in ledger.batches) <= CONFIRM_BATCH
    assert not children()  # every sender reaped


def test_a_sender_that_dies_leaves_its_unreported_claims_to_the_leader() -> None:
    """Killed after its first batch was confirmed: the rest of its share comes back to
    be sent by the leader; nothing is confirmed that it did not report."""
    ledger = Ledger()
    items = claims()
    doomed = items[2 * (CONFIRM_BATCH + 10)].entry.name  # sender 0, its 261st claim

    def publish(item: Due, producer: Any) -> bool:
        if item.entry.name == doomed:
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    left = share(ledger, items, sending(publish))

    assert len(left) == CONFIRM_BATCH  # its second batch: never reported
    assert sorted(item.entry.name for item in items) == sorted(
        ledger.confirmed() + [item.entry.name for item in left]
    )
    assert not children()


def test_a_sender_that_dies_while_its_batch_is_confirmed_is_not_an_error() -> None:
    """Killed between its report and the leader's answer (found by the integration test:
    the answer's write failed with BrokenPipeError and stopped the tick): the batch stays
    confirmed, the rest of its share comes back to the leader."""

    class KillingLedger(Ledger):
        def confirm(self, sent: Iterable[Due]) -> None:
            super().confirm(sent)
            if len(self.batches) == 1:
                for pid in children():
                    os.kill(pid, signal.SIGKILL)
                    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped

    ledger = KillingLedger()
    items = claims()

    left = share(ledger, items, sending())

    assert sorted(item.entry.name for item in items) == sorted(
        ledger.confirmed() + [item.entry.name for item in left]
    )
    assert len(ledger.batches[0]) == CONFIRM_BATCH
    assert not children()


def test_a_sender_stuck_for_good_is_killed_and_its_share_left_to_the_leader(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A sender that reports nothing for SILENT_FOR (stuck: a lock it inherited held, a
    broker that never answers) does not hold the tick for ever: the leader kills it and
    sends what it had not reported."""
    monkeypatch.setattr(senders_module, "SILENT_FOR", 0.5)
    ledger = Ledger()
    items = claims()

    def stuck(item: Due, producer: Any) -> bool:
        if item is items[1]:  # sender 1's first claim
            time.sleep(3600)
        return True

    with caplog.at_level(logging.WARNING, logger="celery_pglock.beat"):
        left = share(ledger, items, sending(stuck))

    assert items[1::2] == left
    assert sorted(item.entry.name for item in items[::2]) == sorted(ledger.confirmed())
    assert any("sent nothing for" in r.getMessage() for r in caplog.records)
    assert not children()


def test_a_sender_whose_sends_failed_leaves_them_unconfirmed_and_not_to_the_leader() -> None:
    """A broker error on a message: the sender says so and goes on (as beat does), its
    claim stays unconfirmed (re-sent after pglock_beat_resend_after), not sent again now."""
    ledger = Ledger()
    items = claims()
    refused = {items[0].entry.name, items[1].entry.name}

    left = share(ledger, items, sending(lambda item, producer: item.entry.name not in refused))

    assert [] == left
    assert len(ledger.confirmed()) == CLAIMS - 2
    assert not refused & set(ledger.confirmed())


def test_postgresql_lost_mid_tick_kills_the_senders_and_reaches_the_tick() -> None:
    """A confirmation fails (PostgreSQL restarted, the leader's session gone): the senders
    are killed at once, and the error reaches the tick as it does without senders (the
    claims left unconfirmed are the next leader's)."""

    class FailingLedger(Ledger):
        def confirm(self, sent: Iterable[Due]) -> None:
            if self.batches:
                raise SessionGone("the session with PostgreSQL ended")
            super().confirm(sent)

    def slow(item: Due, producer: Any) -> bool:
        time.sleep(0.001)
        return True

    ledger = FailingLedger()
    with pytest.raises(SessionGone):
        share(ledger, claims(), sending(slow))

    assert 1 == len(ledger.batches)
    assert not children()


def test_leadership_lost_kills_the_senders_and_leaves_the_rest_to_the_next_leader() -> None:
    ledger = Ledger()

    def slow(item: Due, producer: Any) -> bool:
        time.sleep(0.002)
        return True

    left = share(ledger, claims(), sending(slow, still_leading=lambda _: not ledger.batches))

    assert [] == left
    assert 0 < len(ledger.confirmed()) < CLAIMS
    assert not children()


def test_a_stop_lets_the_senders_finish_the_tick_then_is_raised(stop_handler: None) -> None:
    ledger = Ledger()
    items = claims()
    leader = os.getpid()

    def stop_once(item: Due, producer: Any) -> bool:
        if item is items[10]:
            os.kill(leader, signal.SIGTERM)
        return True

    with pytest.raises(Stopped):
        share(ledger, items, sending(stop_once))

    assert sorted(item.entry.name for item in items) == sorted(ledger.confirmed())
    assert not children()


def test_a_second_stop_stops_the_senders_at_once(stop_handler: None) -> None:
    ledger = Ledger()
    items = claims()
    leader = os.getpid()

    def stop_twice(item: Due, producer: Any) -> bool:
        if item is items[10]:
            os.kill(leader, signal.SIGTERM)
            time.sleep(0.2)
            os.kill(leader, signal.SIGTERM)
        time.sleep(0.001)
        return True

    with pytest.raises(Stopped):
        share(ledger, items, sending(stop_twice))

    assert len(ledger.confirmed()) < CLAIMS
    assert not children()


@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2", None])
def test_pglock_beat_senders_must_be_an_int_of_one_or_more(value: Any) -> None:
    with pytest.raises(ConfigurationError, match="pglock_beat_senders must be an int >= 1"):
        senders_option(value)


def test_pglock_beat_senders_accepts_one_and_more() -> None:
    assert (1, 4) == (senders_option(1), senders_option(4))
