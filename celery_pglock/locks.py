"""Advisory locks with a server-enforced lease, and the heartbeat that keeps leases alive.

``acquire`` takes the lock, a fencing token and the ledger claim in one round trip and
returns a ``Lease`` (granted) or a ``Skip`` (why not: ``locked``, ``done``, and with the
coalescing policies of the claim ``superseded`` or ``late``). ``release`` records the outcome and
frees the lock in one more round trip. A session-scope lock without a slot has no outcome
to record: its release is sent without waiting for the reply (``unwaited``), so such a
run costs one round trip.

The lease: while a holder runs, its lock connection has ``idle_session_timeout`` (session
scope) or ``idle_in_transaction_session_timeout`` (transaction scope) set to the lease, and
a heartbeat pings it. A holder that stops responding (SIGSTOP, GC pause, partition) goes
idle, the server ends its session and so frees its lock; on waking, its next ping fails and
the lease is marked lost.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from celery_pglock import signals, unwaited
from celery_pglock.config import Scope
from celery_pglock.db import (
    Connection,
    Database,
    application_name,
    connect,
    serving_tasks,
    translate_error,
)
from celery_pglock.errors import DatabaseUnavailable, LockLost
from celery_pglock.ledger import (
    Claim,
    Skip,
    holder_application_name,
    log_skip,
    record_failure_after_rollback,
    record_outcome,
    short_reason,
)
from celery_pglock.schema import query_texts

logger = logging.getLogger("celery_pglock")

TRY_LOCK = {"session": "pg_try_advisory_lock", "transaction": "pg_try_advisory_xact_lock"}
# unlock_all: the connection is this execution's alone, and a lock the body took on it
# (even ours again: session locks are re-entrant) must not go back to the pool.
UNLOCK = {"session": "pg_advisory_unlock_all()", "transaction": "pg_advisory_unlock_all()"}
ARM_SESSION_LEASE = "set_config('idle_session_timeout', %(lease_ms)s, false)"
# is_local=true: PostgreSQL reverts it when the transaction ends, no disarm needed.
ARM_TRANSACTION_LEASE = "set_config('idle_in_transaction_session_timeout', %(lease_ms)s, true)"
DISARM_SESSION_LEASE = "set_config('idle_session_timeout', %(idle_default)s, false)"
# The ledger CTEs of `acquire` for a lock without a slot: nothing to look up or claim.
NO_LEDGER = (
    "stale AS (SELECT NULL::text AS newer_slot, false AS late), "
    "claim AS (SELECT NULL::integer AS attempts WHERE false)"
)
# The release of a session-scope lock without a slot, sent unwaited: libpq placeholders
# ($1: the configured idle_session_timeout, $2: the pooled application_name).
RELEASE_UNWAITED = (
    b"SELECT pg_advisory_unlock_all(), set_config('idle_session_timeout', $1, false),"
    b" set_config('application_name', $2, false)"
)
RELEASE_UNWAITED_PRE14 = (  # no lease to disarm; $1: the pooled application_name
    b"SELECT pg_advisory_unlock_all(), set_config('application_name', $1, false)"
)
PING_SQL = "SELECT 1"
IDLE = psycopg.pq.TransactionStatus.IDLE
MIN_PING_INTERVAL = 0.2
# An idle heartbeat thread still wakes this often (seconds), so that registering a lease
# whose pings are further apart never has to wake it.
IDLE_WAKE = 5.0
# How long ending the heartbeat thread waits for a ping in flight (seconds).
HEARTBEAT_STOP_WAIT = 2.0


@dataclass
class Lease:
    """A granted lock: what the task sees as ``self.pglock``."""

    claim: Claim
    scope: Scope
    connection: Connection
    token: int
    attempts: int | None
    lease: float | None
    lost_cause: str | None = None
    last_ping: float = field(default_factory=time.monotonic)
    # When the server last answered on the lock's connection (the grant, a ping, a check).
    confirmed: float = field(default_factory=time.monotonic)
    released: bool = False  # release began: the heartbeat must not use the connection

    @property
    def lock(self) -> str:
        return self.claim.lock_name

    @property
    def slot(self) -> str | None:
        return self.claim.slot

    @property
    def known_lost(self) -> bool:
        """True once we know the server took the lock away (no round trip)."""
        return self.lost_cause is not None

    @property
    def lost(self) -> bool:
        """True once the server took the lock away. Asks the server first when it has not
        answered for half the lease: after a freeze (SIGSTOP, a GC pause) the lease may
        have run out before the heartbeat, waking at the same moment, could say so."""
        if not self.known_lost and not self.released and self._unconfirmed():
            self.ask_server()
        return self.known_lost

    def check(self) -> None:
        """Raise ``LockLost`` unless the lock is still held. Asks the server now, after any
        heartbeat ping in flight: a ping that is busy must not read as "held"."""
        if not self.known_lost and not self.released:
            self.ask_server()
        if self.known_lost:
            raise LockLost(
                f"lock {self.lock!r} (token {self.token}) was lost: {self.lost_cause}; "
                "a newer holder may be running, abandon the work"
            )

    def _unconfirmed(self) -> bool:
        return self.lease is not None and time.monotonic() - self.confirmed > self.lease / 2

    def ask_server(self) -> None:
        """One round trip on the lock connection: marks the lease lost if the session ended."""
        # The caller's thread is not using the connection (it is the body's own, or the
        # body's thread is the caller), so waiting for its lock waits only for a ping.
        try:
            self.connection.execute(PING_SQL)
        except psycopg.Error as exc:
            judge_failure(self, exc)
        else:
            self.confirmed = time.monotonic()

    def mark_lost(self, cause: str) -> None:
        if self.known_lost:
            return
        self.lost_cause = cause
        logger.warning(
            "lost lock %r (slot %s, token %d): %s",
            self.lock,
            self.slot,
            self.token,
            cause,
            extra={
                "action": "pglock_lock_lost",
                "lock": self.lock,
                "slot": self.slot,
                "token": self.token,
            },
        )
        signals.lock_lost.send(
            sender=self.claim.task_name,
            lock=self.lock,
            slot=self.slot,
            token=self.token,
            cause=cause,
        )


def ping(lease: Lease) -> None:
    """One heartbeat; marks the lease lost if the server ended the session."""
    conn = lease.connection
    # Never wait behind the task's own query (transaction scope): a busy connection is
    # not idle, so the server will not end it.
    if lease.released or not conn.lock.acquire(blocking=False):
        lease.last_ping = time.monotonic()  # busy, so not idle: next ping in one interval
        return
    conn.lock.release()
    try:
        conn.execute(PING_SQL)
        lease.last_ping = lease.confirmed = time.monotonic()
    except psycopg.Error as exc:
        judge_failure(lease, exc)


def judge_failure(lease: Lease, exc: psycopg.Error) -> None:
    """Mark ``lease`` lost if ``exc``, raised on its connection, means the session ended."""
    if lease.released:  # released meanwhile: the connection is no longer the lease's
        return
    # The session is gone on an OperationalError, or when the server ended it with an
    # error of another class (IdleInTransactionSessionTimeout is an InternalError).
    # Otherwise (e.g. the task's transaction is aborted) the session and the lock live on.
    if isinstance(exc, psycopg.OperationalError) or lease.connection.closed:
        lease.mark_lost(f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}")


class Heartbeat:
    """One thread per process pings every active lease at a third of its length."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._leases: dict[int, Lease] = {}
        self._wake = threading.Condition()
        self._wake_at = 0.0  # when the thread wakes next; 0 while it is awake
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pglock-heartbeat", daemon=True)
        self._thread.start()

    @property
    def idle(self) -> bool:
        with self._wake:
            return not self._leases

    def register(self, lease: Lease) -> None:
        with self._wake:
            self._leases[id(lease)] = lease
            # Only if the thread would sleep past this lease's first ping: a wake-up per
            # task made each short task back to back ~8% slower (a thread switch).
            if self._wake_at > lease.last_ping + _interval(lease):
                self._wake.notify()

    def unregister(self, lease: Lease) -> None:
        with self._wake:
            self._leases.pop(id(lease), None)

    def stop(self, timeout: float) -> None:
        """End the thread (it pings nothing more) and wait for it, at most ``timeout``."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._wake:
                wait = self._next_wait()
                self._wake_at = time.monotonic() + wait
                if not self._stopped:
                    self._wake.wait(timeout=wait)
                self._wake_at = 0.0
                if self._stopped:
                    return
                due = [lease for lease in self._leases.values() if _due(lease)]
            for lease in due:
                ping(lease)

    def _next_wait(self) -> float:
        live = [lease for lease in self._leases.values() if not lease.known_lost]
        if not live:  # a lost lease is never pinged again: waiting on it would spin
            return IDLE_WAKE
        now = time.monotonic()
        waits = (_interval(lease) - (now - lease.last_ping) for lease in live)
        return max(0.0, min(waits))


def _interval(lease: Lease) -> float:
    return max(MIN_PING_INTERVAL, (lease.lease or 60.0) / 3)


def _due(lease: Lease) -> bool:
    return not lease.known_lost and time.monotonic() - lease.last_ping >= _interval(lease) * 0.95


_heartbeat: Heartbeat | None = None
_heartbeat_lock = threading.Lock()


def heartbeat() -> Heartbeat:
    """This process's heartbeat thread."""
    with _heartbeat_lock:
        return _current_heartbeat()


def _current_heartbeat() -> Heartbeat:
    global _heartbeat  # noqa: PLW0603 - per-process singleton, recreated after fork
    if _heartbeat is None or _heartbeat.pid != os.getpid():  # threads do not survive fork
        _heartbeat = Heartbeat()
    return _heartbeat


def watch(lease: Lease) -> None:
    """Keep ``lease`` alive: this process's heartbeat thread pings it from now on."""
    with _heartbeat_lock:  # never registered with a heartbeat that `unwatch` is stopping
        _current_heartbeat().register(lease)


def unwatch(lease: Lease) -> None:
    """Stop pinging ``lease``. Outside a worker the thread ends with the last lease: a
    locked call in a test suite or a script leaves no thread of ours behind it."""
    global _heartbeat  # noqa: PLW0603
    with _heartbeat_lock:
        found = _heartbeat
        if found is None or found.pid != os.getpid():
            return
        found.unregister(lease)
        if serving_tasks() or not found.idle:
            return
        _heartbeat = None
        found.stop(timeout=HEARTBEAT_STOP_WAIT)


def acquire_fragments(scope: Scope, *, armed: bool, slotted: bool) -> dict[str, str]:
    """The fragments of the ``acquire`` query: the try-lock, the lease, the ledger claim."""
    arm = ARM_SESSION_LEASE if scope == "session" else ARM_TRANSACTION_LEASE
    return {
        "try_lock": TRY_LOCK[scope],
        "arm_lease": arm if armed else "NULL",
        "ledger": query_texts()["acquire_ledger"] if slotted else NO_LEDGER,
    }


def _fragments(db: Database, scope: Scope, lease: float | None, claim: Claim) -> dict[str, str]:
    armed = lease is not None and (scope == "transaction" or db.lease_supported)
    return acquire_fragments(scope, armed=armed, slotted=claim.slot is not None)


def acquire(
    db: Database,
    claim: Claim,
    scope: Scope,
    lease: float | None,
    *,
    waited: Connection | None = None,
) -> Lease | Skip:
    """Try the lock and claim the slot; a ``Lease`` to run under, or the ``Skip`` why not.

    ``waited``: a connection of ``db`` that already waited for the lock (the ``wait_lock``
    query), used instead of a pooled one; re-entrant advisory locks make the try succeed.
    """
    params = {
        **claim.params(),
        "lease_ms": str(round(lease * 1000)) if lease else "0",
        "application_name": holder_application_name(claim.task_id, os.getpid(), claim.host),
    }
    if scope == "session":
        db.check_session_scope()
    query = db.tables.query("acquire", **_fragments(db, scope, lease, claim))
    conn, row = _execute_acquire(db, query, params, scope, waited)
    if not row[0]:
        # The holder may have just ended, its release sent unwaited and not yet read by
        # its server process: one more try, a round trip later, before skipping.
        conn, row = _execute_acquire(db, query, params, scope, conn)
    acquired, token, attempts, newer_slot, late = row
    if acquired and (claim.slot is None or attempts is not None):
        granted = Lease(claim, scope, conn, token, attempts, lease)
        if lease is not None:
            watch(granted)
        return granted
    reason = "superseded" if newer_slot else "late" if late else "locked"
    return _skip(db, conn, claim, scope, held=bool(acquired), reason=reason, newer=newer_slot)


def _execute_acquire(
    db: Database, query: bytes, params: dict[str, Any], scope: Scope, waited: Connection | None
) -> tuple[Connection, tuple[Any, ...]]:
    # A pooled connection may have died while idle (server restart, a DBA's
    # idle_session_timeout): such a failure is retried on the next one. Every pooled
    # connection may be dead (each failure discards one), so: the pool's size, plus one.
    attempts = db.pool.max_size + 1
    for attempt in range(attempts):
        conn = waited if waited is not None else db.getconn()
        try:
            if conn.autocommit != (scope == "session"):  # a waited one is in its transaction
                conn.autocommit = scope == "session"
            row = conn.execute(query, params).fetchone()
            assert row is not None
            return conn, row
        except psycopg.OperationalError as exc:
            db.putconn(conn, clean=False)
            if attempt == attempts - 1 or waited is not None or not conn.closed:
                raise translate_error(exc, db.settings) from None
        except BaseException:
            db.putconn(conn, clean=False)
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _skip(
    db: Database,
    conn: Connection,
    claim: Claim,
    scope: Scope,
    *,
    held: bool,
    reason: str = "locked",
    newer: str | None = None,
) -> Skip:
    unlock = UNLOCK[scope] if held else "NULL"
    try:
        skip = log_skip(conn, db, claim, reason, held=unlock, newer_slot=newer)
        if scope == "transaction":
            conn.commit()
    except psycopg.Error as exc:
        db.putconn(conn, clean=False)
        raise translate_error(exc, db.settings) from None
    # Held and then freed: the lease was armed, so let the pool's reset disarm it.
    db.putconn(conn, clean=not held or scope == "transaction")
    return skip


@dataclass(frozen=True)
class Released:
    recorded: bool
    lost: bool


def release(db: Database, lease: Lease, state: str, reason: str | None = None) -> Released:
    """Record the attempt's outcome and free the lock; says if the lock was lost."""
    if lease.lease is not None:
        unwatch(lease)
    lease.released = True
    conn = lease.connection
    if _release_unwaited(db, lease):
        return Released(recorded=False, lost=lease.known_lost)
    params = {
        **lease.claim.params(),
        "token": lease.token,
        "state": state,
        "reason": short_reason(reason) if reason else None,
        "idle_default": db.idle_defaults["idle_session_timeout"],
        "idle_application_name": application_name(),
    }
    disarm = DISARM_SESSION_LEASE if lease.scope == "session" and db.lease_supported else "NULL"
    query = db.tables.query("release", unlock=UNLOCK[lease.scope], disarm_lease=disarm)
    try:
        if lease.scope == "session" and conn.info.transaction_status != IDLE:
            conn.rollback()  # the body left it open; the pool would roll back our outcome too
        row = conn.execute(query, params).fetchone()
        if lease.scope == "transaction":
            conn.commit()
    except psycopg.Error as exc:
        db.putconn(conn, clean=False)
        if not isinstance(exc, psycopg.OperationalError) and not conn.closed:
            raise
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    db.putconn(conn, clean=True)
    return Released(recorded=bool(row and row[0]), lost=lease.known_lost)


def _release_unwaited(db: Database, lease: Lease) -> bool:
    """Send a mutex-only release without waiting; False when it must be waited for."""
    conn = lease.connection
    if lease.scope != "session" or lease.claim.slot is not None:
        return False  # an outcome to record, or a transaction to commit
    if conn.closed or conn.info.transaction_status != IDLE or not unwaited.quiet(conn):
        return False  # the body left a transaction open, or the server spoke (ended it?)
    if db.lease_supported:
        query = RELEASE_UNWAITED
        params = [db.idle_defaults["idle_session_timeout"], application_name()]
    else:
        query, params = RELEASE_UNWAITED_PRE14, [application_name()]
    try:
        unwaited.send(conn, query, params, db.settings.connect_timeout)
    except psycopg.Error as exc:
        db.putconn(conn, clean=False)  # closed if broken: its session, and lock, are gone
        lease.mark_lost(f"connection lost before the lock was released: {exc}")
        return True
    db.park_unwaited(conn)
    return True


def _recover_outcome(db: Database, lease: Lease, state: str, reason: str | None) -> bool:
    """The lock's connection broke at the end: keep the outcome if nobody took over."""
    if lease.claim.slot is None:
        return False
    try:
        if lease.scope == "transaction":
            _record_rolled_back(db, lease)
            return False  # the outcome rolled back with the body: not recorded
        return record_outcome(db, lease.claim, lease.token, state, reason)
    except (psycopg.Error, OSError, DatabaseUnavailable):
        return False


def _record_rolled_back(db: Database, lease: Lease) -> None:
    """Transaction scope, the connection lost before the commit: the claim, the body's
    writes and the outcome rolled back together; record the attempt failed, so that the
    slot's row does not stay as it was before the attempt (it may run again)."""
    reason = f"connection lost before the commit: {lease.lost_cause}"
    with connect(db.settings) as conn:
        record_failure_after_rollback(conn, db, lease.claim, lease.token, short_reason(reason))


def abandon(db: Database, lease: Lease) -> None:
    """Give the connection back after the body's transaction failed (transaction scope)."""
    if lease.lease is not None:
        unwatch(lease)
    db.putconn(lease.connection, clean=False)
