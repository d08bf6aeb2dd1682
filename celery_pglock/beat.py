"""Beat schedulers that send each slot once, however many replicas run.

- ``PgLockSchedulerMixin`` adds the protection to any scheduler class (Celery's
  ``PersistentScheduler``, django-celery-beat's ``DatabaseScheduler``).
- ``PgLockScheduler`` is a complete scheduler whose state lives in PostgreSQL
  (``celery beat -S pglock``).

Each tick: a standby sends nothing; the leader (or, with ``pglock_beat_leader = False``,
every replica) computes the due slot of each entry (``slots``; with ``pglock_beat_catch_up``
also the slots missed since the last one sent), claims all of them in one
round trip, and sends only what it claimed, with the slot in the ``pglock_slot`` header.
In leader mode the claim runs on the leader's own connection, so a replica whose session
was ended (frozen past the lease, partitioned) cannot claim, and so cannot send.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import psycopg
from celery.beat import Scheduler

from celery_pglock import keys, slots
from celery_pglock.config import APP_DEFAULTS, CatchUp, app_settings, catch_up_option
from celery_pglock.db import (
    FIX_BEAT,
    HOSTNAME,
    connect,
    database,
    ensure_schema,
    pooler_message,
    transaction_pooled,
)
from celery_pglock.errors import ConfigurationError, PgLockError
from celery_pglock.keys import default_lock_name, leader_lock_name, lock_key
from celery_pglock.leader import LeaderElection
from celery_pglock.ledger import ORPHAN_SWEEP_PARAMS, abandoned
from celery_pglock.messages import ENTRY_HEADER, SLOT_HEADER
from celery_pglock.names import lock_name
from celery_pglock.retention import AutoPrune
from celery_pglock.task import PgLockMixin

logger = logging.getLogger("celery_pglock.beat")

SLOT_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
STANDBY_POLL = 0.2  # how often a standby looks at whether it became the leader
RESEND_CHECK_EVERY = 5.0
ORPHAN_SWEEP_EVERY = 10.0  # seconds between two looks for rows a dead attempt left running
RESEND_HORIZON = 86400.0
# Per-entry settings read from an entry's ``options`` (and stripped before sending).
CATCH_UP_OPTION = "pglock_catch_up"
CATCH_UP_LIMIT_OPTION = "pglock_catch_up_limit"
ENTRY_OPTIONS = (CATCH_UP_OPTION, CATCH_UP_LIMIT_OPTION)


class Due(NamedTuple):
    entry: Any
    slot: str
    lock_name: str


class _EntryWithHeaders:
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


class PgLockSchedulerMixin:
    """Send each (entry, slot) once across replicas; put it before the scheduler class."""

    app: Any
    data: Any
    max_interval: float
    producer: Any
    schedule: Any
    reserve: Any
    apply_async: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = kwargs.get("app") or args[0]
        conf = app.conf
        self.pglock_settings = app_settings(app)
        self.pglock_namespace = keys.namespace(conf.get("pglock_namespace"), app.main)
        self.pglock_leader_mode = bool(_conf(conf, "pglock_beat_leader"))
        self.pglock_lease = float(_conf(conf, "pglock_beat_lease"))
        self.pglock_align = bool(_conf(conf, "pglock_beat_align_intervals"))
        self.pglock_resend_after = float(_conf(conf, "pglock_beat_resend_after"))
        self.pglock_grace = max(10.0, 3 * self.pglock_lease)
        self.pglock_catch_up = _catch_up_conf(conf)
        self.pglock_replica = f"{HOSTNAME}:{os.getpid()}"
        self._last_slot: dict[str, str] = {}
        self._stored_slots: dict[str, str] = {}  # last slot sent per entry, read on takeover
        self._leading = False
        self._wake_at: dict[str, float] = {}
        self._next_resend_check = 0.0
        self._next_sweep = 0.0
        self._outage = False
        self._pruner = AutoPrune.from_conf(conf, self.pglock_settings, self.pglock_namespace)
        self._election: LeaderElection | None = None
        self._schema_ready = False
        self.pglock_tables = self.pglock_settings.tables
        super().__init__(*args, **kwargs)
        beat_max = float(_conf(conf, "pglock_beat_max_interval"))
        self.max_interval = min(self.max_interval, beat_max)

    def _start_election(self) -> LeaderElection:
        # Started on the first tick, not in __init__: `celery beat` also builds a lazy
        # scheduler just to print its banner, and that one must not compete.
        settings = self.pglock_settings
        with connect(settings) as conn:
            if transaction_pooled(conn, settings):
                raise ConfigurationError(pooler_message(settings, "beat leader election", FIX_BEAT))
        name = leader_lock_name(self.pglock_namespace)
        self._election = LeaderElection(
            self.pglock_settings, lock_name=name, key=lock_key(name), lease=self.pglock_lease
        )
        self._election.start()
        return self._election

    @property
    def is_leader(self) -> bool:
        if not self.pglock_leader_mode:
            return True
        election = self._election or self._start_election()
        return election.is_leader()

    def tick(self, *args: Any, **kwargs: Any) -> float:
        now = datetime.now(timezone.utc)
        if not self.is_leader:
            self._leading = False
            return min(STANDBY_POLL, self.max_interval)
        try:
            if not self._leading:
                self._take_over()
            due = self._due(now)
            if due:
                self._send(due)
            self._resend_unconfirmed()
            self._sweep_orphans()
            self._pruner.maybe_run()  # pglock_ledger_retention: hourly, in slices
        except (psycopg.Error, PgLockError) as exc:
            if self.pglock_leader_mode and not self.is_leader:
                return min(STANDBY_POLL, self.max_interval)  # lost the lease: not an outage
            self._db_error(exc)
            return min(1.0, self.max_interval)
        if self._outage:
            self._outage = False
            logger.info("beat reaches PostgreSQL again", extra={"action": "pglock_beat_db_back"})
        return self._next_wake()

    def _take_over(self) -> None:
        """Start sending from the last slots sent, as stored, not from this replica's memory.

        Otherwise a slot that fell due while no replica led (the leader froze or died just
        before sending it) would be taken as already seen, and silently never sent.
        """
        rows = self._run_query("beat_state", {"namespace": self.pglock_namespace})
        self._stored_slots = {row[0]: row[1] for row in rows if row[1]}
        self._last_slot.clear()
        self._wake_at.clear()
        self._leading = True

    def _due(self, now: datetime) -> list[Due]:
        due = []
        clock = now.timestamp()
        for entry in list(self.schedule.values()):
            if self._wake_at.get(entry.name, 0.0) > clock or not _enabled(entry, now):
                continue
            slot = self._slot_if_due(entry, now)
            if slot is not None:
                lock_name = self._lock_name(entry)
                for missed in self._missed_before(entry, slot, now):  # pglock_beat_catch_up="all"
                    due.append(Due(entry, missed, lock_name))
                due.append(Due(entry, slot, lock_name))
        return due

    def _slot_if_due(self, entry: Any, now: datetime) -> str | None:
        name = entry.name
        if name not in self._last_slot:
            # Seen for the first time: go on from the last slot sent, or, for an entry never
            # sent, do not fire a past occurrence (like stock beat).
            seed = slots.slot_for(entry.schedule, now, align_intervals=self.pglock_align)
            stored = self._stored_slots.get(name) if seed else None
            self._last_slot[name] = stored or seed or ""
        slot, wait = slots.due_state(
            entry.schedule,
            now,
            self._last_slot[name] or None,
            align_intervals=self.pglock_align,
            max_wait=self.max_interval,
        )
        if slot is None and self._last_slot[name] == "":
            return self._unaligned_slot(entry, now)
        self._wake_at[name] = now.timestamp() + wait
        if slot is not None and _age(slot, now) > self.pglock_grace:
            if self._catch_up(entry)[0] != "none":
                return slot  # pglock_beat_catch_up: the newest slot is sent however late
            self._last_slot[name] = slot  # missed while no replica was leading: not sent
            logger.info(
                "slot %s of %s was missed (older than %.0f s): not sent",
                slot,
                name,
                self.pglock_grace,
                extra={"action": "pglock_beat_missed", "entry": name, "slot": slot},
            )
            return None
        return slot

    def _unaligned_slot(self, entry: Any, now: datetime) -> str | None:
        # Celery's own phase (pglock_beat_align_intervals = False, or unknown schedules):
        # the slot is this process's fire time, so replicas do not share it.
        is_due, wait = entry.is_due()
        self._wake_at[entry.name] = now.timestamp() + min(wait, self.max_interval)
        return slots.format_slot(now) if is_due else None

    def _catch_up(self, entry: Any) -> tuple[CatchUp, int]:
        """The entry's catch-up policy and bound: its ``options`` over the app's."""
        policy, limit = self.pglock_catch_up
        options = entry.options or {}
        try:
            return catch_up_option(
                options.get(CATCH_UP_OPTION, policy),
                options.get(CATCH_UP_LIMIT_OPTION, limit),
                f"beat entry {entry.name!r}",
            )
        except ConfigurationError as exc:  # an entry edited at run time (django-celery-beat)
            logger.error(
                "%s; using the app's %r", exc, policy, extra={"action": "pglock_beat_bad_option"}
            )
            return policy, limit

    def _missed_before(self, entry: Any, slot: str, now: datetime) -> list[str]:
        """Catch-up ``all``: the slots after the last one sent and before ``slot``, oldest
        first, so that at most ``pglock_beat_catch_up_limit`` go out with ``slot``."""
        policy, limit = self._catch_up(entry)
        last = self._last_slot.get(entry.name) or ""
        if policy != "all" or limit < 2 or not last:
            return []
        before = slots.parse_slot(slot) - timedelta(seconds=1)
        missed, more = slots.slots_since(
            entry.schedule, before, last, limit=limit - 1, align_intervals=self.pglock_align
        )
        if missed:
            logger.info(
                "catching up %d missed slot(s) of %s from %s%s",
                len(missed),
                entry.name,
                missed[0],
                " (older ones not sent: pglock_beat_catch_up_limit)" if more else "",
                extra={"action": "pglock_beat_catch_up", "entry": entry.name, "slot": missed[0]},
            )
        return missed

    def _lock_name(self, entry: Any) -> str:
        """The lock name a worker will use for this entry's message, when beat can tell."""
        task = self.app.tasks.get(entry.task)
        if not isinstance(task, PgLockMixin):
            return default_lock_name(self.pglock_namespace, entry.task)
        options = task.pglock_options()
        try:
            return lock_name(entry.task, options, entry.args or (), entry.kwargs or {})
        except ConfigurationError:  # the worker reports it, with the message's arguments
            logger.debug("pglock_key of %s failed in beat", entry.task, exc_info=True)
            return default_lock_name(options.namespace, entry.task)

    def _send(self, due: list[Due]) -> None:
        claimed = self._claim(due)
        claimed_at = time.monotonic()
        for item in due:
            self._last_slot[item.entry.name] = item.slot
        sent = []
        for item in due:
            if (item.entry.name, item.slot) not in claimed:
                continue
            checked_at = time.monotonic()
            if not self._still_leading(claimed_at):
                logger.warning(
                    "not sending %s: leadership lost",
                    item.entry.name,
                    extra={"action": "pglock_beat_not_sent", "entry": item.entry.name},
                )
                return
            if checked_at - claimed_at >= self.pglock_lease / 3:
                claimed_at = checked_at  # the server just confirmed it: one ping per third
            if self._publish(item):
                sent.append(item)
        self._confirm(sent)

    def _still_leading(self, claimed_at: float) -> bool:
        # A pause between claim and publish (SIGSTOP) may have cost us the lease.
        if self._election is None or time.monotonic() - claimed_at < self.pglock_lease / 3:
            return self.is_leader
        return self._election.verify()

    def _publish(self, item: Due) -> bool:
        entry = self.reserve(item.entry)
        headers = {SLOT_HEADER: item.slot, ENTRY_HEADER: entry.name}
        logger.info(
            "Scheduler: Sending due task %s (%s) slot %s",
            entry.name,
            entry.task,
            item.slot,
            extra={"action": "pglock_beat_sent", "entry": entry.name, "slot": item.slot},
        )
        try:
            view = _EntryWithHeaders(entry, headers)
            self.apply_async(view, producer=self.producer, advance=False)
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

    def _run_query(self, name: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """Run a beat query: on the leader's connection in leader mode, else pooled."""
        if self._election is None:
            db = database(self.pglock_settings)
            with db.connection() as conn:
                return _rows(conn.execute(db.tables.query(name), params))
        leader_conn = self._election.connection
        if leader_conn is None:
            raise PgLockError("this replica is no longer the beat leader")
        try:
            self._ensure_schema(leader_conn)
            return _rows(leader_conn.execute(self.pglock_tables.query(name), params))
        except psycopg.OperationalError as exc:
            self._election.step_down(f"leader connection failed: {exc}")
            raise

    def _ensure_schema(self, conn: Any) -> None:
        if not self._schema_ready:
            settings = self.pglock_settings
            ensure_schema(conn, self.pglock_tables, auto_migrate=settings.auto_migrate)
            self._schema_ready = True

    def _claim(self, due: list[Due]) -> set[tuple[str, str]]:
        # One order for every replica: the schedule's order is a set's (per process hash
        # seed), and two replicas inserting the same claims in opposite orders deadlock.
        due = sorted(due, key=_claim_order)
        rows = self._run_query(
            "beat_claim",
            {
                "namespace": self.pglock_namespace,
                "replica": self.pglock_replica,
                "entries": [d.entry.name for d in due],
                "slots": [d.slot for d in due],
                "lock_names": [d.lock_name for d in due],
                "keys": [lock_key(d.lock_name) for d in due],
                "tasks": [d.entry.task for d in due],
            },
        )
        return {(entry, slot) for entry, slot in rows}

    def _confirm(self, sent: Iterable[Due]) -> None:
        sent = sorted(sent, key=_claim_order)  # rows updated in the claims' order
        if not sent:
            return
        self._run_query(
            "beat_confirm",
            {
                "namespace": self.pglock_namespace,
                "entries": [d.entry.name for d in sent],
                "slots": [d.slot for d in sent],
                "run_ats": [_slot_time(d.slot) for d in sent],
            },
        )

    def _sweep_orphans(self) -> None:
        """Record failed the ledger rows a dead attempt left running (they are final then)."""
        now = time.monotonic()
        if now < self._next_sweep:
            return
        self._next_sweep = now + ORPHAN_SWEEP_EVERY
        abandoned(self._run_query("abandon_orphans", ORPHAN_SWEEP_PARAMS))

    def _resend_unconfirmed(self) -> None:
        """Re-send claims whose sender died between claim and publish."""
        now = time.monotonic()
        if now < self._next_resend_check:
            return
        self._next_resend_check = now + RESEND_CHECK_EVERY
        rows = self._run_query(
            "beat_unsent",
            {
                "namespace": self.pglock_namespace,
                "replica": self.pglock_replica,
                "after": self.pglock_resend_after,
                "horizon": RESEND_HORIZON,
            },
        )
        entries = self.schedule
        due = [Due(entries[e], s, self._lock_name(entries[e])) for e, s in rows if e in entries]
        sent = []
        for item in due:
            logger.warning(
                "re-sending %s slot %s: its claim was never confirmed",
                item.entry.name,
                item.slot,
                extra={"action": "pglock_beat_resend", "entry": item.entry.name},
            )
            if self._publish(item):
                sent.append(item)
        self._confirm(sent)

    def _next_wake(self) -> float:
        if not self._wake_at:
            return self.max_interval
        soonest = min(self._wake_at.values()) - time.time()
        return max(0.0, min(soonest, self.max_interval))

    def _db_error(self, exc: BaseException) -> None:
        if not self._outage:
            self._outage = True
            logger.error(
                "beat cannot reach PostgreSQL; sending nothing until it can: %s",
                exc,
                extra={"action": "pglock_beat_db_unavailable"},
            )

    def close(self) -> None:
        if self._election is not None:
            self._election.close()
        super().close()  # type: ignore[misc]


def _rows(cursor: Any) -> list[tuple[Any, ...]]:
    return list(cursor.fetchall()) if cursor.description else []


def _catch_up_conf(conf: Any) -> tuple[CatchUp, int]:
    """The app's catch-up policy, and every ``beat_schedule`` entry's, checked at start-up."""
    policy, limit = _conf(conf, "pglock_beat_catch_up"), _conf(conf, "pglock_beat_catch_up_limit")
    default = catch_up_option(policy, limit, "app.conf")
    for name, spec in (conf.get("beat_schedule") or {}).items():
        options = (spec.get("options") if isinstance(spec, dict) else None) or {}
        catch_up_option(
            options.get(CATCH_UP_OPTION, policy),
            options.get(CATCH_UP_LIMIT_OPTION, limit),
            f"beat_schedule[{name!r}].options",
        )
    return default


def _conf(conf: Any, name: str) -> Any:
    value = conf.get(name)
    return APP_DEFAULTS[name] if value is None else value


def _slot_time(slot: str) -> datetime:
    return datetime.strptime(slot, SLOT_FORMAT).replace(tzinfo=timezone.utc)


def _age(slot: str, now: datetime) -> float:
    try:
        return (now - _slot_time(slot)).total_seconds()
    except ValueError:
        return 0.0


def _enabled(entry: Any, now: datetime) -> bool:
    """Respect django-celery-beat's per-entry switches (enabled, start time, expiry)."""
    model = getattr(entry, "model", None)
    if model is None:
        return True
    if not getattr(model, "enabled", True):
        return False
    start, expires = getattr(model, "start_time", None), getattr(model, "expires", None)
    if start is not None and start > now:
        return False
    return not (expires is not None and expires < now)


class PgLockScheduler(PgLockSchedulerMixin, Scheduler):  # type: ignore[misc]
    """A complete scheduler: entries from ``beat_schedule``, state in PostgreSQL.

    No local shelve file: what was sent lives in the ``beat``/``beat_sends`` tables, so a
    replica that takes over knows it.
    """

    def setup_schedule(self) -> None:
        self.install_default_entries(self.data)
        self.merge_inplace(self.app.conf.beat_schedule)
        self._load_state()

    def _load_state(self) -> None:
        try:
            with connect(self.pglock_settings) as conn:
                self._ensure_schema(conn)
                query = self.pglock_tables.query("beat_state")
                rows = conn.execute(query, {"namespace": self.pglock_namespace}).fetchall()
            state = {row[0]: row for row in rows}
        except (psycopg.Error, PgLockError) as exc:
            self._db_error(exc)
            return
        for name, entry in self.data.items():
            if name in state and state[name][2] is not None:
                entry.last_run_at = state[name][2]
                entry.total_run_count = state[name][3]

    def sync(self) -> None:
        """Nothing to do: state is written to PostgreSQL as each slot is sent."""

    @property
    def info(self) -> str:
        mode = "leader election" if self.pglock_leader_mode else "active-active"
        return f"    . celery-pglock: {mode}, schema {self.pglock_settings.schema!r}"


def _claim_order(item: Due) -> tuple[str, str]:
    return (item.entry.name, item.slot)
