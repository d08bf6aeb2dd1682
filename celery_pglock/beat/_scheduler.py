"""The schedulers: ``PgLockSchedulerMixin`` for any scheduler class, ``PgLockScheduler``.

The first ticks start the replica: they reach PostgreSQL, waiting for it while it is away
(``startup``: a WARNING per failed attempt, backing off to 30 s, beat sleeping between
ticks as usual), and start the leader election; a misconfiguration stops beat with one
line and exit status 1. Every later tick, in order: a standby sends nothing; the leader
(or, with ``pglock_beat_leader = False``, every replica) reads the changes of the entries
stored in PostgreSQL (``stored``), asks the planner for the due slots (``planner``),
claims all of them in one round trip (``claims``), and publishes only what it claimed,
with the slot in the ``pglock_slot`` header, confirming the sends in small batches as
they go (``sending``; a large tick by forked senders with ``pglock_beat_senders``:
``senders``); then it re-sends claims never confirmed, sweeps rows dead attempts
left running, and prunes the ledger (``retention``). A new leader first re-sends, at
once, every claim a stopped or dead leader left unconfirmed. Stopped mid-tick (SIGTERM:
Celery's handler closes the scheduler and raises SystemExit inside the tick, held till the
message or batch in flight is on the broker and confirmed), the replica sends the rest of
the tick first (up to ``STOP_FINISH_WITHIN``; a second stop: at once) and confirms what it
sent before it resigns.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Collection, Iterable, Iterator, Mapping
from datetime import datetime, timezone
from typing import Any, NoReturn

from celery.beat import Scheduler

from celery_pglock import _waiting as waiting
from celery_pglock._config import TaskOptions
from celery_pglock._keys import leader_lock_name, lock_key
from celery_pglock._messages import ENTRY_HEADER, SLOT_HEADER
from celery_pglock._startup import StartupWait, refuse_to_start
from celery_pglock.beat._claims import DEADLOCK_DETECTED, RESEND_LIMIT, BeatClaims
from celery_pglock.beat._entries import entry_lock_name
from celery_pglock.beat._freshness import FreshnessWatch
from celery_pglock.beat._leader import LeaderElection
from celery_pglock.beat._planner import Due, SlotPlanner
from celery_pglock.beat._producer import declaring_once
from celery_pglock.beat._row_leader import RowElection
from celery_pglock.beat._senders import SHARED_FROM, Sending, send_shared
from celery_pglock.beat._sending import STOP_FINISH_WITHIN, Confirmations, HeldStops, batched
from celery_pglock.beat._settings import ENTRY_OPTIONS, BeatSettings
from celery_pglock.beat._stored import StoredEntries
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    PgLockError,
    SessionGone,
)
from celery_pglock.retention import AutoPrune
from celery_pglock.store._connections import FIX_BACKEND, pooler_message
from celery_pglock.store._database import check_server, chosen_backend, database
from celery_pglock.store.statements import Row, opened

logger = logging.getLogger("celery_pglock.beat")

STANDBY_POLL = 0.2  # how often a standby looks at whether it became the leader
RESEND_CHECK_EVERY = 5.0
ORPHAN_SWEEP_EVERY = 10.0  # seconds between two looks for rows a dead attempt left running
REGISTER_EVERY = 60.0  # seconds between two refreshes of the tasks our entries send
# Seconds between two looks at the stored entries' changes (one number read): every tick
# at pglock_beat_max_interval = 1, ticks a second apart give or take.
ENTRY_CHECK_EVERY = 0.5


class EntryWithHeaders:
    """An entry whose ``options`` carry our headers; everything else is the entry's own.

    Copying the entry breaks django-celery-beat's ``ModelEntry``, and upstream mutates
    ``options["headers"]`` in place, so a thin view is the safe way to add headers.
    """

    def __init__(self, entry: Any, headers: dict[str, Any]) -> None:
        self._entry = entry
        # Our per-entry settings are not apply_async options: never send them.
        options = {k: v for k, v in (entry.options or {}).items() if k not in ENTRY_OPTIONS}
        options["headers"] = {**(options.get("headers") or {}), **headers}
        self.options = options

    def __getattr__(self, name: str) -> Any:
        return getattr(self._entry, name)


def _never() -> bool:
    return False


class PgLockSchedulerMixin:
    """Send each (entry, slot) once across replicas; put it before the scheduler class."""

    app: Any
    data: Any
    max_interval: float
    producer: Any
    Producer: Any  # the producer class (Celery: the app's amqp.Producer)
    schedule: Any
    reserve: Any
    apply_async: Any
    should_sync: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app") or args[0]
        self.pglock_beat = BeatSettings.from_app(app)
        self.pglock_settings = self.pglock_beat.settings
        self.pglock_tables = self.pglock_settings.tables
        self.pglock_claims = BeatClaims(self.pglock_beat, self._run_query)
        self._leading = False
        self._next_resend_check = 0.0
        self._next_sweep = 0.0
        self._next_register = 0.0
        self._next_entry_check = 0.0
        self._outage = False
        self._pruner = AutoPrune.from_conf(
            app.conf, self.pglock_settings, self.pglock_beat.namespace
        )
        self._election: LeaderElection | RowElection | None = None
        self._on_rows = False  # leader election on rows (the rows lock backend)
        self._freshness = FreshnessWatch(self.pglock_beat, self._run_query, self)
        self._startup: StartupWait | None = None  # created by the first tick
        self._started = False
        self._exit_status: int | None = None  # set when beat must stop (see close)
        self._ticking = False  # close() inside a tick (SIGTERM) waits for the tick to unwind
        self._close_pending = False
        self._lock_options: dict[str, TaskOptions] = {}  # per task beat cannot import
        self._stored = StoredEntries(app, self.pglock_beat.namespace)
        self._seen_schedule: tuple[int, int] | None = None  # the schedule's id and size
        super().__init__(*args, **kwargs)
        self.Producer = declaring_once(self.Producer)  # no queue copied per message
        self.max_interval = min(self.max_interval, self.pglock_beat.max_interval)
        self._planner = SlotPlanner(self.pglock_beat, self.max_interval)

    @property
    def is_leader(self) -> bool:
        """Whether this replica sends (always, in active-active mode)."""
        if not self.pglock_beat.leader_mode:
            return True
        return self._election is not None and self._election.is_leader()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._started and not self._start():
            return min(STANDBY_POLL, self.max_interval)
        now = datetime.now(timezone.utc)
        if not self.is_leader:
            self._leading = False
            return min(STANDBY_POLL, self.max_interval)
        self._ticking = True
        try:
            self._lead(now)
        except PgLockError as exc:
            if self.pglock_beat.leader_mode and not self.is_leader:
                return min(STANDBY_POLL, self.max_interval)  # lost the lease: not an outage
            self._db_error(exc)
            return min(1.0, self.max_interval)
        finally:
            self._ticking = False
            if self._close_pending:  # closed inside the tick: resign now it has unwound
                self.close()
        if self._outage:
            self._outage = False
            logger.info("beat reaches PostgreSQL again", extra={"action": "pglock_beat_db_back"})
        return min(self._planner.next_wake(), self._freshness.wake_in())

    def _start(self) -> bool:
        """On a tick before the replica started: start it if an attempt is due
        (``startup``); whether it has started. On a tick, not in ``__init__``: `celery
        beat` also builds a lazy scheduler just to print its banner, which must not compete."""
        if self._startup is None:
            self._startup = StartupWait(self.pglock_settings, "beat", logger)
        wait = self._startup
        if not wait.due():
            return False
        try:
            self._start_once()
        except DatabaseUnavailable as exc:  # an outage, or a misconfiguration
            self._start_failed(wait, exc)
            return False
        except ConfigurationError as exc:
            self._refuse(exc)
        wait.succeeded()
        self._started = True
        return True

    def _start_once(self) -> None:
        settings = self.pglock_settings
        if not self.pglock_beat.leader_mode:
            database(settings)  # the pool every replica claims through, checked
        else:
            self._on_rows = self._election_on_rows(check_server(settings))
        self._load_state_if_pending()
        if self.pglock_beat.leader_mode:
            self._start_election()

    def _election_on_rows(self, pooled: bool) -> bool:
        """Whether the leader is elected on rows (``chosen_backend``), said once."""
        settings = self.pglock_settings
        backend, why = chosen_backend(settings, pooled)
        if backend == "advisory" and pooled:
            what = "beat leader election on an advisory lock"
            raise ConfigurationError(pooler_message(settings, what, FIX_BACKEND))
        logger.info(
            "beat leader election on %s: %s",
            "rows (a leader row with a lease)" if backend == "rows" else "an advisory lock",
            why,
            extra={"action": "pglock_lock_backend", "backend": backend},
        )
        return backend == "rows"

    def _start_failed(self, wait: StartupWait, exc: DatabaseUnavailable) -> None:
        try:
            wait.failed(exc)
        except PgLockError as fatal:  # not worth waiting for
            self._refuse(fatal)

    def _refuse(self, exc: BaseException) -> NoReturn:
        # Celery's beat service takes SystemExit for a shutdown and exits 0: the status
        # rides through close(), which the service calls as it stops.
        self._exit_status = 1
        refuse_to_start("beat", logger, exc)

    def _load_state_if_pending(self) -> None:
        """Load what ``setup_schedule`` could not while PostgreSQL was away (none here)."""

    def _lead(self, now: datetime) -> None:
        if not self._leading:
            # From the last slots sent as stored, not from this replica's memory.
            self._planner.take_over(self.pglock_claims.last_slots_sent())
            self._leading = True
            self._next_register = 0.0  # a new leader says at once what it sends
            if self.pglock_beat.leader_mode:  # whoever claimed them no longer leads
                self._resend_unconfirmed(at_once=True)
        code = self.schedule
        self._read_stored_changes(code.keys())
        entries = self._stored.beside(code)
        # New names only come with another schedule (django-celery-beat's, reloaded) or
        # a stored change: else the planner reads only the entries whose look has come.
        seen, self._seen_schedule = self._seen_schedule, (id(code), len(code))
        due = self._planner.due(entries, now, self._lock_name, rescan=seen != self._seen_schedule)
        if due:
            self._send(due)
        self._resend_unconfirmed()
        self._sweep_orphans()
        self._freshness.maybe_check(entries, self._lock_name, now)
        self._register_tasks()
        self._pruner.maybe_run()  # pglock_ledger_retention: hourly, in slices

    def _start_election(self) -> None:
        name = leader_lock_name(self.pglock_beat.namespace)
        election = RowElection if self._on_rows else LeaderElection
        self._election = election(
            self.pglock_settings, lock_name=name, key=lock_key(name), lease=self.pglock_beat.lease
        )
        self._election.start()

    def _read_stored_changes(self, code: Collection[str]) -> None:
        """The stored entries changed since the last look (at most every
        ``ENTRY_CHECK_EVERY``: so at every tick at ``pglock_beat_max_interval = 1``)."""
        now = time.monotonic()
        if now < self._next_entry_check:
            return
        self._next_entry_check = now + ENTRY_CHECK_EVERY
        for name in self._stored.refresh(self._run_query, code):
            self._planner.changed(name)

    def _entries(self) -> Mapping[str, Any]:
        """Every entry this replica sends: ``beat_schedule``'s (the code's win a name both
        define) and those stored in PostgreSQL (``celery_pglock.schedules``)."""
        return self._stored.beside(self.schedule)

    def _reserve(self, entry: Any) -> Any:
        """Celery's ``reserve`` (the entry's next state), kept where the entry lives."""
        stored = self._stored.entries
        if entry.name not in stored or stored[entry.name] is not entry:
            return self.reserve(entry)
        stored[entry.name] = next(entry)
        return stored[entry.name]

    def _lock_name(self, entry: Any) -> str:
        return entry_lock_name(self.app, entry, self._lock_options)

    def _send(self, due: list[Due]) -> None:
        self._freshness.sent(item.entry.name for item in due)  # its next look reads them
        confirmations = Confirmations(self.pglock_claims)
        claims = self._claimed(due, confirmations)
        if self.pglock_beat.senders > 1 and len(due) >= SHARED_FROM:
            claims = self._send_shared(claims, confirmations)
        self._send_claimed(claims, confirmations)

    def _send_shared(self, claims: Iterator[Due], confirmations: Confirmations) -> Iterator[Due]:
        """Claim, and send by ``pglock_beat_senders`` forked senders (``senders``), a stop
        held as in ``_send_claimed``; what is left for this process to send (a sender
        died). A stop finishes the tick by the senders, then is raised here."""
        try:
            with HeldStops() as stops:
                claimed = list(claims)
                left = send_shared(
                    claimed, self.pglock_beat.senders, self._sending(), confirmations, stops
                )
        except BaseException as exc:
            confirmations.flush_on_stop(exc)
            raise
        sent_here = {id(item) for item in left}
        for item in claimed:  # the entries' next state, once their messages are out
            if id(item) not in sent_here:
                self._reserve(item.entry)
        return iter(left)

    def _sending(self) -> Sending:
        return Sending(
            publish=lambda item, producer: self._apply(item, item.entry, producer),
            new_producer=self._sender_producer,
            still_leading=self._still_leading,
            lease=self.pglock_beat.lease,
        )

    def _sender_producer(self) -> Any:
        """In a forked sender: a producer on a broker connection of its own. The schedule
        is the leader's to sync (``Scheduler.apply_async`` syncs every few minutes)."""
        self.should_sync = _never
        return self.Producer(self.app.connection_for_write(), auto_declare=False)

    def _claimed(self, due: list[Due], confirmations: Confirmations) -> Iterator[Due]:
        """Claim ``due`` and yield what to send. Drawn by ``_send_claimed`` inside its
        held stops: a stop during the claim's round trip, when the claims may already be
        committed, finishes the tick like any other (raised before the sends, it left the
        claims unsent, and a drained beat has no next leader to send them)."""
        claimed = self.pglock_claims.claim(due)
        self._planner.sent(due)
        paused = [item for item in due if (item.entry.name, item.slot) in claimed.paused]
        for item in paused:
            logger.info(
                "Scheduler: not sending %s slot %s: the entry is paused",
                item.entry.name,
                item.slot,
                extra={"action": "pglock_beat_paused", "entry": item.entry.name},
            )
        confirmations.recorded(paused)
        yield from (item for item in due if (item.entry.name, item.slot) in claimed.send)

    def _send_claimed(self, claims: Iterable[Due], confirmations: Confirmations) -> int:
        """Publish ``claims`` in order, confirming them in batches as they go, while this
        replica leads; how many went out. A stop (SIGTERM, Ctrl-C: Celery raises it here),
        held till the message or batch in flight is out and confirmed (``HeldStops``),
        finishes the tick for up to ``STOP_FINISH_WITHIN`` s, a second one stops at once:
        what went out is confirmed, the next leader sends the rest at once."""
        todo, stop, finish_by = iter(claims), None, float("inf")
        while True:
            try:
                # The held stop is delivered (raised) once the batch is out and confirmed.
                with HeldStops() as stops, batched(self.producer, confirmations):
                    self._publish_each(todo, confirmations, finish_by, stops)
                if not stops.received:
                    break  # else a stop whose handler did not raise: send the rest
            except (SystemExit, KeyboardInterrupt) as exc:
                if stop is not None or stops.received > 1:  # a second stop: at once
                    confirmations.flush_on_stop(exc)
                    raise
                stop, finish_by = exc, time.monotonic() + STOP_FINISH_WITHIN
                logger.info(
                    "beat stopping: finishing the tick first (a second stop: at once)",
                    extra={"action": "pglock_beat_stopping"},
                )
            except BaseException as exc:
                confirmations.flush_on_stop(exc)
                raise
        confirmations.flush()
        if stop is not None:
            raise stop
        return confirmations.confirmed

    def _publish_each(
        self, todo: Iterator[Due], confirmations: Confirmations, by: float, stops: HeldStops
    ) -> None:
        checked_at = time.monotonic()
        # A stop is looked at before the next claim is drawn: one drawn and then left was
        # skipped by the rest of the tick, and only a next leader, if one came, sent it.
        while stops.caught is None:
            item = next(todo, None)
            if item is None:
                return
            now = time.monotonic()
            if now > by:
                return  # stopping: the rest is the next leader's, at once
            if not self._still_leading(checked_at):
                logger.warning(
                    "not sending %s: leadership lost",
                    item.entry.name,
                    extra={"action": "pglock_beat_not_sent", "entry": item.entry.name},
                )
                return
            if now - checked_at >= self.pglock_beat.lease / 3:
                checked_at = now  # the server just confirmed it: one ping per third
            if self._publish(item):
                confirmations.sent(item)

    def _still_leading(self, claimed_at: float) -> bool:
        # A pause between claim and publish (SIGSTOP) may have cost us the lease.
        if self._election is None or time.monotonic() - claimed_at < self.pglock_beat.lease / 3:
            return self.is_leader
        return self._election.verify()

    def _publish(self, item: Due) -> bool:
        return self._apply(item, self._reserve(item.entry), self.producer)

    def _apply(self, item: Due, entry: Any, producer: Any) -> bool:
        """Publish ``entry``'s message for ``item``'s slot through ``producer``; whether
        it went out (a broker error is logged, its claim left unconfirmed)."""
        headers = {SLOT_HEADER: item.slot, ENTRY_HEADER: entry.name}
        logger.info(
            "Scheduler: Sending due task %s (%s) slot %s",
            entry.name,
            entry.task,
            item.slot,
            extra={"action": "pglock_beat_sent", "entry": entry.name, "slot": item.slot},
        )
        try:
            view = EntryWithHeaders(entry, headers)
            self.apply_async(view, producer=producer, advance=False)
        except Exception as exc:  # noqa: BLE001 - a broker error must not stop beat
            logger.error(
                "could not send %s slot %s: %s",
                entry.name,
                item.slot,
                exc,
                extra={"action": "pglock_beat_send_failed", "entry": entry.name},
            )
            return False
        return True

    def _run_query(self, name: str, params: dict[str, Any]) -> list[Row]:
        """Run a beat statement: on the leader's session in leader mode, else pooled."""
        if self._election is None:
            with database(self.pglock_settings).statements() as pooled:
                return pooled.rows(name, params)
        leading = self._election.statements()
        if leading is None:
            raise PgLockError("this replica is no longer the beat leader")
        try:
            return leading.rows(name, params)
        except SessionGone as exc:
            # A deadlock rolls a statement back; the session and its lock live on.
            if exc.sqlstate != DEADLOCK_DETECTED:
                self._election.connection_failed(exc)
            raise

    def _sweep_orphans(self) -> None:
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + ORPHAN_SWEEP_EVERY
            self.pglock_claims.sweep_orphans()
            waiting.sweep(self.app, self._run_query)

    def _register_tasks(self) -> None:
        """Say which tasks our entries send, so that workers can tell a stock beat's
        slot-less messages of them (``rogue``)."""
        now = time.monotonic()
        if now < self._next_register:
            return
        self._next_register = now + REGISTER_EVERY
        entries = [e for e in self._entries().values() if not e.task.startswith("celery.")]
        if entries:
            tasks, names = [e.task for e in entries], [e.name for e in entries]
            params = {"namespace": self.pglock_beat.namespace, "tasks": tasks, "entries": names}
            self._run_query("beat_register_tasks", params)

    def _resend_unconfirmed(self, *, at_once: bool = False) -> None:
        """Re-send claims whose sender died or stopped between claim and confirmation:
        older than ``pglock_beat_resend_after``, or ``at_once``, all of them."""
        now = time.monotonic()
        if now < self._next_resend_check and not at_once:
            return
        self._next_resend_check = now + RESEND_CHECK_EVERY
        while True:
            taken: list[tuple[str, str]] = []
            due = self._taken_over(at_once, taken)
            sent = self._send_claimed(due, Confirmations(self.pglock_claims))
            # Taken over by this replica now: a failed send waits for the timer.
            if not at_once or len(taken) < RESEND_LIMIT or sent < len(taken):
                return

    def _taken_over(self, at_once: bool, taken: list[tuple[str, str]]) -> Iterator[Due]:
        """Take over the claims never confirmed (listed in ``taken``) and yield those of
        our entries. Drawn inside the held stops, as ``_claimed``: a stop during the
        statement finishes re-sending what it took over."""
        taken += self.pglock_claims.unconfirmed(at_once=at_once)
        entries = self._entries()
        due = [Due(entries[e], s, self._lock_name(entries[e])) for e, s in taken if e in entries]
        if due:
            logger.warning(
                "re-sending %d claim(s) never confirmed, from %s slot %s",
                len(due),
                due[0].entry.name,
                due[0].slot,
                extra={"action": "pglock_beat_resend", "entry": due[0].entry.name},
            )
        yield from due

    def _db_error(self, exc: BaseException) -> None:
        if not self._outage:
            self._outage = True
            logger.error(
                "beat cannot reach PostgreSQL; sending nothing until it can: %s",
                exc,
                extra={"action": "pglock_beat_db_unavailable"},
            )

    def close(self) -> None:
        if self._ticking:
            # Celery's SIGTERM handler, in the middle of a tick: the SystemExit it raises
            # next finishes the tick (_send_claimed), which then unwinds and resigns here.
            self._close_pending = True
            return
        self._close_pending = False
        if self._election is not None:
            self._election.close()
        super().close()  # type: ignore[misc]
        if self._exit_status is not None:
            raise SystemExit(self._exit_status)


class PgLockScheduler(PgLockSchedulerMixin, Scheduler):  # type: ignore[misc]
    """A complete scheduler: entries from ``beat_schedule``, state in PostgreSQL.

    No local shelve file: what was sent lives in the ``beat``/``beat_sends`` tables, so a
    replica that takes over knows it.
    """

    def setup_schedule(self) -> None:
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        self._state_pending = True
        with contextlib.suppress(DatabaseUnavailable):  # else loaded once PostgreSQL answers
            self._load_state()

    def _load_state_if_pending(self) -> None:
        if self._state_pending:
            self._load_state()

    def _load_state(self) -> None:
        settings = self.pglock_settings
        with opened(settings, outage=True) as statements:
            statements.ensure_schema(auto_migrate=settings.auto_migrate)
            rows = statements.rows("beat_state", {"namespace": self.pglock_beat.namespace})
        state = {row["entry"]: row for row in rows}
        for name, entry in self.data.items():
            if name in state and state[name]["last_run_at"] is not None:
                entry.last_run_at = state[name]["last_run_at"]
                entry.total_run_count = state[name]["total_run_count"]
        self._state_pending = False

    def sync(self) -> None:
        """Nothing to do: state is written to PostgreSQL as each slot is sent."""

    @property
    def info(self) -> str:
        mode = "leader election" if self.pglock_beat.leader_mode else "active-active"
        senders = self.pglock_beat.senders
        shared = f", {senders} senders for large ticks" if senders > 1 else ""
        return f"    . celery-pglock: {mode}{shared}, schema {self.pglock_settings.schema!r}"
