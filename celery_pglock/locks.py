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

import psycopg

from celery_pglock import unwaited
from celery_pglock.config import Scope
from celery_pglock.db import (
    Connection,
    Database,
    application_name,
    connect,
    translate_error,
)
from celery_pglock.errors import DatabaseUnavailable
from celery_pglock.heartbeat import unwatch, watch
from celery_pglock.ledger import (
    SUCCEEDED,
    holder_application_name,
    log_skip,
    record_failure_after_rollback,
    record_outcome_when_reachable,
    short_reason,
)
from celery_pglock.protocol import Claim, Lease, Released, Skip
from celery_pglock.schema import query_texts

logger = logging.getLogger("celery_pglock")

TRY_LOCK = {"session": "pg_try_advisory_lock", "transaction": "pg_try_advisory_xact_lock"}
# The `lock` fragment of `acquire`: whether it got a key, and which.
LOCK_ONE = "SELECT {try_lock}(%(key)s) AS acquired, %(key)s::bigint AS key"
# pglock_concurrency > 1: the first free one of the lock name's keys, tried in order.
LOCK_ANY = (
    "SELECT k IS NOT NULL AS acquired, k AS key "
    "FROM {{try_lock_any}}(%(keys)s::bigint[], %(slot_lock)s::integer[], {xact}) AS k"
)
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
IDLE = psycopg.pq.TransactionStatus.IDLE


def acquire_fragments(
    scope: Scope, *, armed: bool, slotted: bool, concurrency: int = 1
) -> dict[str, str]:
    """The fragments of the ``acquire`` query: the try-lock, the lease, the ledger claim."""
    arm = ARM_SESSION_LEASE if scope == "session" else ARM_TRANSACTION_LEASE
    if concurrency == 1:
        lock = LOCK_ONE.replace("{try_lock}", TRY_LOCK[scope])
    else:
        lock = LOCK_ANY.format(xact="true" if scope == "transaction" else "false")
    return {
        "lock": lock,
        "arm_lease": arm if armed else "NULL",
        "ledger": query_texts()["acquire_ledger"] if slotted else NO_LEDGER,
    }


def _fragments(db: Database, scope: Scope, lease: float | None, claim: Claim) -> dict[str, str]:
    armed = lease is not None and (scope == "transaction" or db.lease_supported)
    slotted = claim.slot is not None
    return acquire_fragments(scope, armed=armed, slotted=slotted, concurrency=claim.concurrency)


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
    acquired, key, token, attempts, newer_slot, late = row
    if acquired and (claim.slot is None or attempts is not None):
        held = claim if key == claim.key else dataclasses.replace(claim, key=key)
        granted = Lease(held, scope, conn, token, attempts, lease)
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
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            conn.close()  # it reaches a standby: the next one may reach the new primary
            db.putconn(conn, clean=False)
            raise translate_error(exc, db.settings) from None
        except psycopg.OperationalError as exc:
            usable = db.putconn(conn, clean=False)
            if attempt == attempts - 1 or waited is not None or usable:
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
        if isinstance(exc, psycopg.errors.ReadOnlySqlTransaction):
            conn.close()  # demoted under us: the lock there is no lock; record it elsewhere
        usable = db.putconn(conn, clean=False)
        if not isinstance(exc, psycopg.OperationalError) and usable:
            raise
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    db.putconn(conn, clean=True)
    recorded = bool(row and row[0])
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return Released(recorded=recorded, lost=lease.known_lost)


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
        recorded = record_outcome_when_reachable(db, lease.claim, lease.token, state, reason)
    except (psycopg.Error, OSError, DatabaseUnavailable):
        return False
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return recorded


def _record_rolled_back(db: Database, lease: Lease) -> None:
    """Transaction scope, the connection lost before the commit: the claim, the body's
    writes and the outcome rolled back together; record the attempt failed, so that the
    slot's row does not stay as it was before the attempt (it may run again)."""
    reason = f"connection lost before the commit: {lease.lost_cause}"
    with connect(db.settings) as conn:
        record_failure_after_rollback(conn, db, lease.claim, lease.token, short_reason(reason))
