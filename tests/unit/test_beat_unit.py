"""The beat scheduler's own logic, with a fake clock and its database replaced by memory.

Only this tier replaces the scheduler's database calls (``_run_query``) and its broker
(``apply_async``); the acceptance tests run the real thing.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any, TypeVar, cast

import celery
import pytest
from celery import Celery
from celery.beat import ScheduleEntry, Scheduler
from celery.schedules import crontab, schedule

from celery_pglock import PgLockTask
from celery_pglock._names import lock_name
from celery_pglock.beat import PgLockScheduler
from celery_pglock.beat import _planner as planner_module
from celery_pglock.beat import _scheduler as scheduler_module
from celery_pglock.beat._claims import BeatClaims
from celery_pglock.beat._scheduler import EntryWithHeaders
from celery_pglock.errors import ConfigurationError, DatabaseUnavailable, SessionGone

UTC = timezone.utc
START = datetime(2026, 3, 29, 0, 58, 0, 400000, UTC)  # an hour before Berlin springs forward
EVERY_10 = schedule(timedelta(seconds=10))


# Nothing to re-send, no row a dead attempt left running, no slot waiting.
WITHOUT_ROWS = (
    "beat_unsent",
    "abandon_orphans",
    "beat_register_tasks",
    "stranded_waiting",
    "abandon_waiting",
    "entry_version",  # no entry stored in PostgreSQL
    "entry_changes",
)


class Clock:
    """One fake clock for ``datetime.now``, ``time.time`` and ``time.monotonic`` in beat."""

    def __init__(self, now: datetime) -> None:
        self.now = now

    def time(self) -> float:
        return self.now.timestamp()

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)

    def monotonic(self) -> float:
        return self.time()


def install_clock(monkeypatch: pytest.MonkeyPatch, fake: Clock) -> None:
    """Make beat's clocks (datetime.now, time.time, time.monotonic) read ``fake``."""

    class FakeDatetime(datetime):
        @classmethod
        def now(cls, tz: Any = None) -> datetime:  # type: ignore[override]
            return fake.now.astimezone(tz)

    clocks = SimpleNamespace(time=fake.time, monotonic=fake.monotonic)
    monkeypatch.setattr(scheduler_module, "datetime", FakeDatetime)
    monkeypatch.setattr(scheduler_module, "time", clocks)
    monkeypatch.setattr(planner_module, "time", clocks)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """Beat's clocks, all reading one settable time."""
    fake = Clock(START)
    install_clock(monkeypatch, fake)
    return fake


def state_row(entry: str, last_slot: str) -> dict[str, Any]:
    """A ``beat_state`` row."""
    return {"entry": entry, "last_slot": last_slot, "last_run_at": None, "total_run_count": 1}


@dataclass
class Store:
    """The beat tables in memory: the first claim of an (entry, slot) wins."""

    last: dict[str, str] = field(default_factory=dict)
    claims: dict[tuple[str, str], str] = field(default_factory=dict)

    def query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        if name == "beat_state":
            return [state_row(entry, slot) for entry, slot in self.last.items()]
        if name == "beat_claim":
            wanted = zip(params["entries"], params["slots"], strict=True)
            won = [pair for pair in wanted if pair not in self.claims]
            self.claims.update(dict.fromkeys(won, params["replica"]))
            return [{"entry": e, "slot": s, "paused": False} for e, s in won]  # none paused
        if name == "beat_confirm":
            for entry, slot in zip(params["entries"], params["slots"], strict=True):
                self.last[entry] = max(slot, self.last.get(entry, ""))
            return []
        if name in WITHOUT_ROWS:
            return []  # nothing to re-send, no row a dead attempt left running, none waiting
        raise AssertionError(f"unexpected query {name}")


class SimulatedScheduler(PgLockScheduler):
    """``PgLockScheduler`` whose database is a ``Store`` and whose sends are recorded."""

    def __init__(self, app: Celery, store: Store, name: str = "replica") -> None:
        self.store = store
        self.sent: list[tuple[str, str, dict[str, Any]]] = []
        super().__init__(app=app)
        self.pglock_beat = replace(self.pglock_beat, replica=name)
        self.pglock_claims = BeatClaims(self.pglock_beat, self._run_query)

    @property
    def producer(self) -> None:  # type: ignore[override] # no broker at this tier
        return None

    def _load_state(self) -> None:
        """No database to read at start-up."""

    def _start_once(self) -> None:
        """No database to reach at start-up."""

    def _run_query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        return self.store.query(name, params)

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> None:
        headers = dict(entry.options["headers"])
        self.sent.append((entry.name, headers["pglock_slot"], headers))

    def slots(self, entry: str = "every10") -> list[str]:
        return [slot for name, slot, _ in self.sent if name == entry]


def make_app(schedule: dict[str, Any] | None = None, **conf: Any) -> Celery:
    """An isolated app in Europe/Berlin, active-active, with no database behind it."""
    app = Celery("unit", set_as_current=False)
    app.conf.update(
        {
            "timezone": "Europe/Berlin",
            "result_expires": None,
            "pglock_dsn": "postgresql://nobody@localhost/none",
            "pglock_beat_leader": False,
            "beat_schedule": schedule or {"every10": {"task": "unit.job", "schedule": 10.0}},
            **conf,
        }
    )
    return app


@pytest.fixture
def app() -> Iterator[Celery]:
    """The default app: one entry every 10 s."""
    app = make_app()
    yield app
    app.close()


def tick_until(scheduler: SimulatedScheduler, clock: Clock, end: datetime) -> None:
    """Tick as ``celery beat`` does: sleep what ``tick()`` returns, until ``end``."""
    while clock.now < end:
        clock.advance(max(scheduler.tick(), 0.01))


# -- EntryWithHeaders -----------------------------------------------------------------


def test_entry_view_adds_headers_without_mutating_the_entry(app: Celery) -> None:
    """The view carries merged headers; the entry's own options are left untouched."""
    entry = ScheduleEntry(
        "e", "unit.job", schedule=EVERY_10, options={"headers": {"a": 1}}, app=app
    )

    view = EntryWithHeaders(entry, {"pglock_slot": "2026-01-01T00:00:00Z"})

    assert {"a": 1, "pglock_slot": "2026-01-01T00:00:00Z"} == view.options["headers"]
    assert {"headers": {"a": 1}} == entry.options


def test_entry_view_keeps_django_style_headers_and_attributes() -> None:
    """A ModelEntry-like entry keeps its own headers and attributes (model, name, args)."""
    model = SimpleNamespace(enabled=True)
    entry = SimpleNamespace(
        name="tick",
        task="unit.job",
        args=[1],
        model=model,
        options={"queue": "q", "headers": {"periodic_task_name": "tick"}},
    )

    view = EntryWithHeaders(entry, {"pglock_slot": "s", "pglock_entry": "tick"})

    expected = {"periodic_task_name": "tick", "pglock_slot": "s", "pglock_entry": "tick"}
    assert expected == view.options["headers"]
    assert "q" == view.options["queue"]
    assert (model, "tick", [1]) == (view.model, view.name, view.args)
    assert {"periodic_task_name": "tick"} == entry.options["headers"]


def test_entry_view_headers_reach_send_task_and_leave_the_entry_alone(app: Celery) -> None:
    """Through Celery's own apply_async (send_task path), the slot header is sent."""
    sent: list[dict[str, Any]] = []

    class Recording(Scheduler):
        def send_task(self, *args: Any, **kwargs: Any) -> None:
            sent.append(kwargs["headers"])

    entry = ScheduleEntry("e", "not.importable", schedule=EVERY_10, options={}, app=app)
    view = EntryWithHeaders(entry, {"pglock_slot": "s"})
    Recording(app, lazy=True).apply_async(view, advance=False)  # type: ignore[arg-type]

    marked = {"celery_beat_task": True} if celery.VERSION[:2] >= (5, 7) else {}  # new in 5.7
    assert [{"pglock_slot": "s", **marked}] == sent
    assert {} == entry.options


# -- when slots are sent ---------------------------------------------------------------


def test_an_entry_never_sent_skips_the_occurrence_already_past(app: Celery, clock: Clock) -> None:
    """On first sight with nothing stored, the current slot is not fired, the next one is."""
    scheduler = SimulatedScheduler(app, Store())

    tick_until(scheduler, clock, START + timedelta(seconds=25))

    assert ["2026-03-29T00:58:10Z", "2026-03-29T00:58:20Z"] == scheduler.slots()


def test_a_new_sender_goes_on_from_the_stored_slot(app: Celery, clock: Clock) -> None:
    """Taking over, a replica sends the slot that fell due after the last stored one."""
    scheduler = SimulatedScheduler(app, Store(last={"every10": "2026-03-29T00:57:50Z"}))

    scheduler.tick()

    assert ["2026-03-29T00:58:00Z"] == scheduler.slots()


def test_a_slot_older_than_the_grace_is_not_sent(clock: Clock) -> None:
    """A slot due longer ago than the grace (15 s with a 5-s lease) is logged as missed."""
    app = make_app({"minutely": {"task": "unit.job", "schedule": 60.0}})
    clock.now = datetime(2026, 3, 29, 0, 58, 20, tzinfo=UTC)
    scheduler = SimulatedScheduler(app, Store(last={"minutely": "2026-03-29T00:56:00Z"}))

    scheduler.tick()

    assert [] == scheduler.slots("minutely")
    assert "2026-03-29T00:58:00Z" == scheduler._planner.last_slot["minutely"]


def test_a_slot_within_the_grace_is_sent_late(clock: Clock) -> None:
    """A slot due 12 s ago, inside the grace, is still sent."""
    app = make_app({"minutely": {"task": "unit.job", "schedule": 60.0}})
    clock.now = datetime(2026, 3, 29, 0, 58, 12, tzinfo=UTC)
    scheduler = SimulatedScheduler(app, Store(last={"minutely": "2026-03-29T00:57:00Z"}))

    scheduler.tick()

    assert ["2026-03-29T00:58:00Z"] == scheduler.slots("minutely")


def test_ticking_often_sends_each_slot_once(app: Celery, clock: Clock) -> None:
    """Many ticks inside one slot send it once."""
    scheduler = SimulatedScheduler(app, Store(last={"every10": "2026-03-29T00:57:50Z"}))

    for _ in range(50):
        scheduler.tick()
        clock.advance(0.1)

    assert ["2026-03-29T00:58:00Z"] == scheduler.slots()


def test_only_the_replica_whose_claim_wins_sends(app: Celery, clock: Clock) -> None:
    """Two active-active replicas on one store: each slot is sent by exactly one of them."""
    store = Store(last={"every10": "2026-03-29T00:57:50Z"})
    replicas = [SimulatedScheduler(app, store, name) for name in ("a", "b")]

    for _ in range(300):
        for replica in replicas:
            replica.tick()
        clock.advance(0.1)

    sent = sorted(replicas[0].slots() + replicas[1].slots())
    assert sent == sorted(set(sent))
    assert 4 == len(sent)


def test_sends_carry_the_slot_and_entry_headers(app: Celery, clock: Clock) -> None:
    """Each send has ``pglock_slot`` (the nominal time) and ``pglock_entry`` headers."""
    scheduler = SimulatedScheduler(app, Store(last={"every10": "2026-03-29T00:57:50Z"}))

    scheduler.tick()

    _, _, headers = scheduler.sent[0]
    assert {"pglock_slot": "2026-03-29T00:58:00Z", "pglock_entry": "every10"} == headers


def test_beat_names_the_lock_the_worker_will_take(clock: Clock) -> None:
    """Beat and worker derive the same lock name from ``pglock_key`` and the entry's args."""
    app = make_app({"charge": {"task": "unit.charge", "schedule": 10.0, "args": (7,)}})

    @app.task(
        base=PgLockTask,
        name="unit.charge",
        pglock_key=lambda a, **_: f"account:{a}",
        shared=False,
    )
    def charge(account_id: int) -> None: ...

    scheduler = SimulatedScheduler(app, Store())
    task = cast(PgLockTask, app.tasks["unit.charge"])

    in_beat = scheduler._lock_name(scheduler.schedule["charge"])
    in_worker = lock_name(task.name, task.pglock_options(), (7,), {})

    assert ("account:7", "account:7") == (in_beat, in_worker)


# -- identical slots on every replica --------------------------------------------------


def simulate(
    app: Celery, clock: Clock, starts: dict[str, datetime], end: datetime
) -> dict[str, list[str]]:
    """Run replicas (each alone, with its own store) on one timeline; their sent slots."""
    schedulers: dict[str, SimulatedScheduler] = {}
    wakes = [(start, name) for name, start in starts.items()]
    heapq.heapify(wakes)
    while wakes and wakes[0][0] < end:
        at, name = heapq.heappop(wakes)
        clock.now = at
        replica = schedulers.setdefault(name, SimulatedScheduler(app, Store(), name))
        sleep = max(replica.tick(), 0.01) + 0.003  # beat's loop overhead
        heapq.heappush(wakes, (at + timedelta(seconds=sleep), name))
    return {name: [f"{e} {s}" for e, s, _ in replica.sent] for name, replica in schedulers.items()}


def test_replicas_started_apart_send_identical_slot_sequences(clock: Clock) -> None:
    """Replicas started 83.7 s apart send the same slots, across a DST switch."""
    app = make_app(
        {
            "every10": {"task": "unit.job", "schedule": 10.0},
            "quarter": {"task": "unit.job", "schedule": crontab(minute="*/15")},
            "hourly": {"task": "unit.job", "schedule": crontab(minute=0)},
        },
        pglock_beat_max_interval=30.0,
    )
    later = START + timedelta(seconds=83.7)
    end = START + timedelta(minutes=20)

    sent = simulate(app, clock, {"early": START, "late": later}, end)

    common = [s for s in sent["early"] if s.split()[1] > later.strftime("%Y-%m-%dT%H:%M:%SZ")]
    assert common == sent["late"]
    assert "hourly 2026-03-29T01:00:00Z" in common  # 03:00 Berlin, just after the switch
    assert "quarter 2026-03-29T01:15:00Z" in common
    assert 100 < len(common)


# -- leadership ------------------------------------------------------------------------


class FakeElection:
    """A leader election whose answer the test sets; counts the server checks."""

    def __init__(self) -> None:
        self.leader = True
        self.connection = None
        self.verified = 0

    def is_leader(self) -> bool:
        return self.leader

    def verify(self) -> bool:
        self.verified += 1
        return self.leader

    def close(self) -> None:
        """Nothing to release."""


def test_losing_the_lease_mid_tick_is_not_reported_as_an_outage(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """A claim that fails because leadership was lost logs no database-outage error."""
    election = FakeElection()

    class LosesLease(SimulatedScheduler):
        def _run_query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
            election.leader = False  # the server ended the leader's session
            raise SessionGone("terminating connection due to idle-session timeout")

    scheduler = LosesLease(make_app(pglock_beat_leader=True), Store())
    scheduler._election = election  # type: ignore[assignment]

    with caplog.at_level(logging.INFO, logger="celery_pglock.beat"):
        wait = scheduler.tick()

    assert [] == scheduler.sent
    assert [] == [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert wait <= scheduler_module.STANDBY_POLL


def test_a_database_error_while_leading_is_reported_once(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """An outage logs one error however many ticks fail, and recovery logs once."""
    failing = True

    class Flaky(SimulatedScheduler):
        def _run_query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
            if failing:
                raise DatabaseUnavailable("connection refused")
            return super()._run_query(name, params)

    scheduler = Flaky(make_app(), Store())
    with caplog.at_level(logging.INFO, logger="celery_pglock.beat"):
        for _ in range(5):
            scheduler.tick()
            clock.advance(1)
        failing = False
        scheduler.tick()

    actions = [getattr(r, "action", None) for r in caplog.records]
    assert 1 == actions.count("pglock_beat_db_unavailable")
    assert 1 == actions.count("pglock_beat_db_back")


class SlowPublisher(SimulatedScheduler):
    """Each send takes 0.1 s of fake time; the election is the test's."""

    clock: Clock
    election: FakeElection
    lose_after: int | None = None

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> None:
        super().apply_async(entry, producer, advance, **kwargs)
        self.clock.advance(0.1)
        if self.lose_after is not None and len(self.sent) >= self.lose_after:
            self.election.leader = False


def slow_leader(clock: Clock, entries: int, lose_after: int | None = None) -> SlowPublisher:
    """A leader with ``entries`` entries all due now, sending each in 0.1 s."""
    schedule = {f"e{i:03d}": {"task": "unit.job", "schedule": 10.0} for i in range(entries)}
    store = Store(last=dict.fromkeys(schedule, "2026-03-29T00:57:50Z"))
    scheduler = SlowPublisher(make_app(schedule, pglock_beat_leader=True), store)
    scheduler.clock, scheduler.election, scheduler.lose_after = clock, FakeElection(), lose_after
    scheduler._election = scheduler.election  # type: ignore[assignment]
    return scheduler


def test_a_long_batch_checks_leadership_once_per_third_of_the_lease(clock: Clock) -> None:
    """Sending 100 entries over 10 s asks the server about every 5/3 s, not per send."""
    scheduler = slow_leader(clock, 100)

    scheduler.tick()

    assert 100 == len(scheduler.sent)
    assert 5 <= scheduler.election.verified <= 6


def test_a_leader_that_loses_its_lease_mid_batch_sends_no_more(clock: Clock) -> None:
    """Once the server says the lease is gone, the rest of the claimed batch is not sent."""
    scheduler = slow_leader(clock, 100, lose_after=30)

    scheduler.tick()

    assert 30 == len(scheduler.sent)


Stopped = TypeVar("Stopped", bound=SlowPublisher)


class StoppedMidTick(SlowPublisher):
    """A SIGTERM reaches beat right after its ``stop_after``-th send of the tick."""

    stop_after = 2

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> None:
        super().apply_async(entry, producer, advance, **kwargs)
        if len(self.sent) == self.stop_after:
            signal.raise_signal(signal.SIGTERM)


@contextlib.contextmanager
def celery_stop_handler() -> Iterator[None]:
    """SIGTERM handled as Celery's beat handler does: SystemExit wherever beat is."""

    def celery_stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    assert threading.current_thread() is threading.main_thread()  # HeldStops swaps here
    previous = signal.signal(signal.SIGTERM, celery_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_leader(cls: type[Stopped], entries: int, clock: Clock) -> Stopped:
    """A ``cls`` leader of ``entries`` entries, each of them due now."""
    schedule = {f"e{i}": {"task": "unit.job", "schedule": 10.0} for i in range(entries)}
    store = Store(last=dict.fromkeys(schedule, "2026-03-29T00:57:50Z"))
    scheduler = cls(make_app(schedule, pglock_beat_leader=True), store)
    scheduler.clock, scheduler.election = clock, FakeElection()
    scheduler._election = scheduler.election  # type: ignore[assignment]
    return scheduler


def test_a_stop_between_two_sends_finishes_the_tick_without_losing_one(clock: Clock) -> None:
    """Chaos seed 61847: the stop was taken after the next claim was drawn, which was then
    neither sent nor left to anyone (no leader follows a drained beat): a slot lost."""
    scheduler = stopped_leader(StoppedMidTick, 5, clock)
    with celery_stop_handler(), pytest.raises(SystemExit):
        scheduler.tick()

    assert sorted(name for name, _, _ in scheduler.sent) == [f"e{i}" for i in range(5)]


class StoppedDuringClaim(SlowPublisher):
    """A SIGTERM reaches beat while its claim is on the server: the claims commit, and
    the stop is raised before their rows come back (psycopg waiting for the answer)."""

    def _run_query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        rows = super()._run_query(name, params)
        if name == "beat_claim":
            signal.raise_signal(signal.SIGTERM)
        return rows


def test_a_stop_during_the_claim_sends_and_confirms_what_was_claimed(clock: Clock) -> None:
    """A rolling deploy's SIGTERM during the claim's round trip: the claims were committed
    and SystemExit left the tick before anything was sent; a drained beat has no next
    leader to send them (tests/faults/test_pgbouncer.py: 'beat claim ... never sent')."""
    scheduler = stopped_leader(StoppedDuringClaim, 5, clock)
    with celery_stop_handler(), pytest.raises(SystemExit):
        scheduler.tick()

    assert sorted(name for name, _, _ in scheduler.sent) == [f"e{i}" for i in range(5)]
    assert set(scheduler.store.last.values()) == {scheduler.sent[0][1]}  # all confirmed


class StoppedDuringTakeover(SlowPublisher):
    """A new leader takes over claims a stopped one left unconfirmed, and a SIGTERM
    reaches it while that statement is on the server (taken over, rows not back)."""

    left: list[tuple[str, str]]

    def _run_query(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        if name != "beat_unsent":
            return super()._run_query(name, params)
        taken, self.left = self.left, []
        if taken:
            signal.raise_signal(signal.SIGTERM)
        return [{"entry": entry, "slot": slot} for entry, slot in taken]


def test_a_stop_during_the_takeover_resends_what_was_taken_over(clock: Clock) -> None:
    scheduler = stopped_leader(StoppedDuringTakeover, 3, clock)
    scheduler.left = [(f"e{i}", "2026-03-29T00:57:50Z") for i in range(3)]
    with celery_stop_handler(), pytest.raises(SystemExit):
        scheduler.tick()

    assert [(name, slot) for name, slot, _ in scheduler.sent] == [
        (f"e{i}", "2026-03-29T00:57:50Z") for i in range(3)
    ]


# -- The leader's statements -------------------------------------------------------------


class ElectionOnOneStatement:
    """A won election whose session answers every statement with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.stepped_down: list[str] = []

    def statements(self) -> Any:
        def rows(name: str, params: dict[str, Any]) -> list[Any]:
            raise self.error

        return SimpleNamespace(rows=rows)

    def connection_failed(self, exc: Exception) -> None:
        self.step_down(f"leader connection failed: {exc}")

    def step_down(self, cause: str) -> None:
        self.stepped_down.append(cause)


def failing_with(sqlstate: str) -> SessionGone:
    # As the store names every OperationalError met on a session: "the session ended".
    error = SessionGone(f"the session with PostgreSQL ended: ({sqlstate})")
    error.sqlstate = sqlstate
    return error


@pytest.mark.parametrize(
    ("sqlstate", "steps_down"), [("40P01", False), ("57P01", True)], ids=["deadlock", "ended"]
)
def test_the_leader_steps_down_when_its_session_ended_not_when_a_statement_deadlocked(
    app: Celery, sqlstate: str, steps_down: bool
) -> None:
    """A deadlock ends a statement (PostgreSQL rolled it back), not the leader's session
    or its lock: the leader stays; a session ended (57P01, the server shut it) steps down."""
    scheduler = PgLockScheduler(app=app)
    election = ElectionOnOneStatement(failing_with(sqlstate))
    scheduler._election = cast(Any, election)

    with pytest.raises(SessionGone):
        scheduler._run_query("beat_claim", {})

    assert steps_down == bool(election.stepped_down)


def test_beat_s_banner_says_how_many_senders_share_a_large_tick(app: Celery) -> None:
    assert "senders" not in PgLockScheduler(app=app).info
    app.conf.pglock_beat_senders = 2
    assert ", 2 senders for large ticks," in PgLockScheduler(app=app).info


def test_beat_refuses_a_pglock_beat_senders_that_is_not_a_count(app: Celery) -> None:
    app.conf.pglock_beat_senders = "2"
    with pytest.raises(ConfigurationError, match="pglock_beat_senders must be an int >= 1"):
        PgLockScheduler(app=app)
