"""Advisory locks with a server-enforced lease: acquire and release.

``acquire`` takes the lock, a fencing token and the ledger claim in one round trip and
returns a ``Lease`` (granted) or a ``Skip`` (why not: ``locked``, ``done``, and with the
coalescing policies of the claim ``superseded`` or ``late``). ``release`` records the outcome and
frees the lock in one more round trip. A session-scope lock without a slot has no outcome
to record: its release is sent without waiting for the reply (``unwaited``), so such a
run costs one round trip.

The lease: while a holder runs, its lock connection has ``idle_session_timeout`` (session
scope) or ``idle_in_transaction_session_timeout`` (transaction scope) set to the lease, and
the ``heartbeat`` pings it; the types passed (``Claim``, ``Lease``, ``Skip``, ``Released``)
are in ``protocol``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

from celery_pglock import shared
from celery_pglock.errors import DatabaseError, ReadOnlyServer, SessionGone, WaitEnded
from celery_pglock.heartbeat import unwatch, watch
from celery_pglock.ledger import (
    SUCCEEDED,
    holder_application_name,
    record_failure_after_rollback,
    record_outcome_when_reachable,
    record_skip,
    short_reason,
)
from celery_pglock.protocol import Claim, Lease, Released, Skip
from celery_pglock.store import unwaited
from celery_pglock.store.connections import application_name, connect, in_transaction
from celery_pglock.store.database import Database
from celery_pglock.store.driver import Connection
from celery_pglock.store.failures import boundary
from celery_pglock.values import Scope

logger = logging.getLogger("celery_pglock")


def lease_ms(seconds: float | None) -> str | None:
    """A lease for the statements (``set_lease``): milliseconds, or None for none."""
    return None if seconds is None else str(max(1, round(seconds * 1000)))


def acquire_params(claim: Claim, scope: Scope, armed_ms: str | None) -> dict[str, Any]:
    """The parameters of the ``acquire`` statement; ``armed_ms``: the lease to arm, in
    milliseconds (``lease_ms``), or None."""
    return {
        **claim.params(),
        "xact": scope == "transaction",
        "lease_ms": armed_ms,
        "application_name": holder_application_name(claim.task_id, os.getpid(), claim.host),
    }


def release_params(
    lease: Lease, state: str, reason: str | None, disarm: str | None
) -> dict[str, Any]:
    """The parameters of the ``release`` statement; ``disarm``: the lease to put back (the
    session's configured value), or None. Every lock of the connection is freed (a shared
    session's release frees its own key instead: ``shared.release``)."""
    return {
        **lease.claim.params(),
        "token": lease.token,
        "state": state,
        "reason": short_reason(reason) if reason else None,
        "held_key": None,
        "disarm_ms": disarm,
        "idle_application_name": application_name(),
    }


def _armed(db: Database, scope: Scope, seconds: float | None) -> str | None:
    """The lease to arm: none when off, nor in session scope before PostgreSQL 14."""
    return lease_ms(seconds) if scope == "transaction" or db.lease_supported else None


def acquire(
    db: Database,
    claim: Claim,
    scope: Scope,
    lease_seconds: float | None,
    *,
    waited: Connection | None = None,
) -> Lease | Skip:
    """Try the lock and claim the slot; a ``Lease`` to run under, or the ``Skip`` why not.

    ``waited``: a connection of ``db`` that already waited for the lock (the ``wait_lock``
    query), used instead of a pooled one; re-entrant advisory locks make the try succeed.
    """
    params = acquire_params(claim, scope, _armed(db, scope, lease_seconds))
    if scope == "session":
        db.check_session_scope()
    query = db.tables.query("acquire" if claim.slot is not None else "acquire_mutex")
    if scope == "session" and waited is None and db.shares_sessions:
        return shared.acquire(db, claim, query, params, lease_seconds)
    conn, row = _execute_acquire(db, query, params, scope, waited)
    if not row[0]:
        # The holder may have just ended, its release sent unwaited and not yet read by
        # its server process: one more try, a round trip later, before skipping.
        conn, row = _execute_acquire(db, query, params, scope, conn)
    acquired, key, token, attempts, newer_slot, late = row
    if acquired and (claim.slot is None or attempts is not None):
        held = claim if key == claim.key else dataclasses.replace(claim, key=key)
        granted = Lease(held, scope, conn, token, attempts, lease_seconds)
        if lease_seconds is not None:
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
            with boundary(db.settings, conn):
                if conn.autocommit != (scope == "session"):  # a waited one is in its transaction
                    conn.autocommit = scope == "session"
                row = conn.execute(query, params).fetchone()
            assert row is not None
            return conn, row
        except ReadOnlyServer:
            conn.close()  # it reaches a standby: the next one may reach the new primary
            db.putconn(conn, clean=False)
            raise
        except (SessionGone, WaitEnded):  # a DBA's statement_timeout or cancel: retried too
            usable = db.putconn(conn, clean=False)
            if attempt == attempts - 1 or waited is not None or usable:
                raise
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
    try:
        with boundary(db.settings):  # any failure an outage (or a misconfiguration): retried
            skip = record_skip(conn, db, claim, reason, held=held, newer_slot=newer)
            if scope == "transaction":
                conn.commit()
    except DatabaseError:
        db.putconn(conn, clean=False)
        raise
    # Held and then freed: the lease was armed, so let the pool's reset disarm it.
    db.putconn(conn, clean=not held or scope == "transaction")
    return skip


def release(db: Database, lease: Lease, state: str, reason: str | None = None) -> Released:
    """Record the attempt's outcome and free the lock; says if the lock was lost."""
    if lease.lease_seconds is not None:
        unwatch(lease)
    lease.released = True
    if lease.shared is not None:
        return _release_shared(db, lease, state, reason)
    conn = lease.lock_connection
    if _release_unwaited(db, lease):
        return Released(recorded=False, lost=lease.known_lost)
    armed = lease.scope == "session" and db.lease_supported  # the lease is to disarm
    disarm = db.idle_defaults["idle_session_timeout"] if armed else None
    params = release_params(lease, state, reason, disarm)
    query = db.tables.query("release")
    try:
        with boundary(db.settings, conn):
            if lease.scope == "session" and in_transaction(conn):
                conn.rollback()  # the body left it open; the pool would roll back our outcome
            row = conn.execute(query, params).fetchone()
            if lease.scope == "transaction":
                conn.commit()
    except DatabaseError as exc:
        if isinstance(exc, ReadOnlyServer):
            conn.close()  # demoted under us: the lock there is no lock; record it elsewhere
        usable = db.putconn(conn, clean=False)
        # Ended, or cut short: the pool's reset frees the lock; record the outcome elsewhere.
        if not isinstance(exc, (SessionGone, WaitEnded)) and usable:
            raise
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    db.putconn(conn, clean=True)
    recorded = bool(row and row[0])
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return Released(recorded=recorded, lost=lease.known_lost)


def _release_shared(db: Database, lease: Lease, state: str, reason: str | None) -> Released:
    """``release`` of a lock on a session the process's runs share (``shared``)."""
    disarm = db.idle_defaults["idle_session_timeout"] if db.lease_supported else None
    params = release_params(lease, state, reason, disarm)
    try:
        row = shared.release(db, lease, db.tables.query("release"), params)
    except DatabaseError as exc:  # the session was ended: its locks are free
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    recorded = bool(row[0])
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return Released(recorded=recorded, lost=lease.known_lost)


def _release_unwaited(db: Database, lease: Lease) -> bool:
    """Send a mutex-only release without waiting; False when it must be waited for."""
    conn = lease.lock_connection
    if lease.scope != "session" or lease.claim.slot is not None:
        return False  # an outcome to record, or a transaction to commit
    if conn.closed or in_transaction(conn) or not unwaited.quiet(conn):
        return False  # the body left a transaction open, or the server spoke (ended it?)
    disarm = db.idle_defaults["idle_session_timeout"] if db.lease_supported else None
    params = [disarm, application_name()]
    try:
        with boundary(db.settings, conn):
            query = db.tables.query("release_unwaited")
            unwaited.send(conn, query, params, db.settings.connect_timeout)
    except DatabaseError as exc:
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
        recorded = record_outcome_when_reachable(db, lease.claim, lease.token, state, reason)
    except (DatabaseError, OSError):
        return False
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return recorded


def _record_rolled_back(db: Database, lease: Lease) -> None:
    """Transaction scope, the connection lost before the commit: the claim, the body's
    writes and the outcome rolled back together; record the attempt failed, so that the
    slot's row does not stay as it was before the attempt (it may run again)."""
    reason = f"connection lost before the commit: {lease.lost_cause}"
    with connect(db.settings) as conn, boundary(db.settings, conn):
        record_failure_after_rollback(conn, db, lease.claim, lease.token, short_reason(reason))
