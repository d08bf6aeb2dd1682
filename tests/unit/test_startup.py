"""The start-up wait's rules, on a made-up clock and server (the real ones: the beat and
worker start-up tests, tests/acceptance/test_startup_outage.py)."""

from __future__ import annotations

import logging

import pytest

from celery_pglock._config import Settings
from celery_pglock._startup import PING_EVERY, StartupWait, delay_after
from celery_pglock.errors import DatabaseMisconfigured, DatabaseUnavailable
from celery_pglock.store._ping import servers

logger = logging.getLogger("tests.startup")
DOWN = DatabaseUnavailable("cannot use PostgreSQL at 'db': Connection refused.")


class World:
    """A clock the test moves, and a server that answers pings or not."""

    def __init__(self) -> None:
        self.now = 100.0
        self.answering = False

    def wait(self, **settings: object) -> StartupWait:
        return StartupWait(
            Settings(dsn="postgresql://app@db/app", **settings),  # type: ignore[arg-type]
            "worker",
            logger,
            clock=lambda: self.now,
            ping=lambda: frozenset({"db:5432"}) if self.answering else frozenset(),
        )

    def until_due(self, wait: StartupWait, step: float = PING_EVERY / 2) -> float:
        """Seconds the made-up clock moves until an attempt is due."""
        began = self.now
        while not wait.due():
            self.now += step
        return self.now - began


def test_attempts_back_off_1_2_4_up_to_30_seconds() -> None:
    """After failure n the next attempt waits 1, 2, 4, 8, 16, then 30 s for ever."""
    assert [1, 2, 4, 8, 16, 30, 30, 30] == [delay_after(n) for n in range(1, 9)]


def test_each_failed_attempt_is_one_warning_with_reason_and_next_delay(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three failures: three WARNINGs saying the attempt, the next delay and why."""
    world = World()
    wait = world.wait()
    caplog.set_level(logging.INFO, logger.name)

    waited = []
    for _ in range(3):
        wait.failed(DOWN)
        waited.append(world.until_due(wait))

    assert [1.0, 2.0, 4.0] == waited
    assert ["WARNING"] * 3 == [r.levelname for r in caplog.records]
    assert "attempt 3 failed, next in 4 s" in caplog.records[-1].getMessage()
    assert "Connection refused" in caplog.records[-1].getMessage()
    assert {"pglock_startup_waiting"} == {r.action for r in caplog.records}  # type: ignore[attr-defined]


def test_a_server_that_comes_back_ends_the_wait_at_once() -> None:
    """A ping that answers where the last did not makes the next attempt due, long before
    a 30-s delay is over."""
    world = World()
    wait = world.wait()
    for _ in range(6):
        wait.failed(DOWN)
    world.now += 3.0
    world.answering = True

    assert world.until_due(wait) <= PING_EVERY


def test_a_server_that_answers_yet_refuses_waits_out_the_delay() -> None:
    """Pings answered already when the attempt failed (too many clients, a standby not
    promoted yet): no early attempt, the delay is waited out."""
    world = World()
    world.answering = True
    wait = world.wait()
    wait.failed(DOWN)
    wait.failed(DOWN)

    assert 2.0 == world.until_due(wait)


def test_a_misconfiguration_is_never_waited_for(caplog: pytest.LogCaptureFixture) -> None:
    """A DatabaseMisconfigured is raised at once, with no WARNING about waiting."""
    wrong = DatabaseMisconfigured("password authentication failed. To fix: …")
    wait = World().wait()

    with pytest.raises(DatabaseMisconfigured):
        wait.failed(wrong)
    assert [] == caplog.records


def test_retry_on_startup_off_gives_up_at_the_first_failure() -> None:
    """pglock_connection_retry_on_startup = False: the first failure ends the start-up,
    naming the setting."""
    wait = World().wait(retry_on_startup=False)

    with pytest.raises(DatabaseUnavailable, match="pglock_connection_retry_on_startup"):
        wait.failed(DOWN)


def test_max_retries_gives_up_after_that_many_retries() -> None:
    """pglock_connection_max_retries = 2: the first attempt and 2 retries, then it gives
    up, naming the setting."""
    world = World()
    wait = world.wait(max_retries=2)
    wait.failed(DOWN)
    wait.failed(DOWN)

    with pytest.raises(DatabaseUnavailable, match="pglock_connection_max_retries = 2"):
        wait.failed(DOWN)
    assert 3 == wait.failures


def test_the_answer_is_said_once_only_after_a_wait(caplog: pytest.LogCaptureFixture) -> None:
    """INFO once PostgreSQL answers after failures; nothing when it answered at once."""
    caplog.set_level(logging.INFO, logger.name)
    world = World()
    at_once, after_two = world.wait(), world.wait()
    after_two.failed(DOWN)
    after_two.failed(DOWN)
    caplog.clear()

    at_once.succeeded()
    after_two.succeeded()

    assert ["INFO"] == [r.levelname for r in caplog.records]
    assert "PostgreSQL answers, after 2 failed attempts" in caplog.records[0].getMessage()


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("postgresql://app@db/app", [{"host": "db"}]),
        (
            "postgresql://app@h1:5432,h2:5433/app",
            [{"host": "h1", "port": "5432"}, {"host": "h2", "port": "5433"}],
        ),
        (
            "postgresql://app@h1,h2:5433/app",
            [{"host": "h1", "port": ""}, {"host": "h2", "port": "5433"}],
        ),
        (
            "host=h1,h2 port=5432 dbname=app",
            [{"host": "h1", "port": "5432"}, {"host": "h2", "port": "5432"}],
        ),
        ("dbname=app", [{}]),
    ],
)
def test_each_server_of_a_dsn_is_pinged_alone(dsn: str, expected: list[dict[str, str]]) -> None:
    """The hosts and ports of a multi-host DSN, paired as libpq pairs them (one port for
    every host, an empty one for the default)."""
    assert expected == servers(dsn)
