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

import logging
import os
import time
from typing import Any

from celery_pglock import _shared as shared
from celery_pglock._heartbeat import unwatch, watch
from celery_pglock._ledger import (
    SUCCEEDED,
    holder_application_name,
    record_failure_after_rollback,
    record_outcome_when_reachable,
    record_skip,
    short_reason,
    when_reachable,
)
from celery_pglock._protocol import Claim, Lease, Released, Skip, verdict
from celery_pglock._row_hold import DEFAULT_ROW_LEASE, RowHold
from celery_pglock._values import Scope
from celery_pglock.errors import DatabaseError, ReadOnlyServer, SessionGone, WaitEnded
from celery_pglock.store._connections import application_name
from celery_pglock.store._database import Database
from celery_pglock.store._lock_sessions import LockSession, Row

logger = logging.getLogger("celery_pglock")

OWN_ATTEMPT_POLL = 0.25  # seconds between looks at a redelivered message's earlier row
OWN_ATTEMPT_SLACK = 1.0  # seconds past its expiry to stop looking (clocks, round trips)


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
    waited: LockSession | None = None,
) -> Lease | Skip:
    """Try the lock and claim the slot; a ``Lease`` to run under, or the ``Skip`` why not.

    ``waited``: a session of ``db`` that already waited for the lock (the ``wait_lock``
    query), used instead of a pooled one; re-entrant advisory locks make the try succeed.
    """
    if scope == "session" and waited is None and db.on_rows:
        return _acquire_on_rows(db, claim, lease_seconds or DEFAULT_ROW_LEASE)
    params = acquire_params(claim, scope, _armed(db, scope, lease_seconds))
    if scope == "session":
        db.check_session_scope()
    name = "acquire" if claim.slot is not None else "acquire_mutex"
    if scope == "session" and waited is None and db.shares_sessions:
        return shared.acquire(db, claim, name, params, lease_seconds)
    session, row = _try_lock(db, name, params, scope, waited)
    if not row["acquired"]:
        # The holder may have just ended, its release sent unwaited and not yet read by
        # its server process: one more try, a round trip later, before skipping.
        session, row = _try_lock(db, name, params, scope, session)
    granted = verdict(claim, row)
    if isinstance(granted, str):
        # A session that waited holds the lock it waited for even when the grant refused
        # (a holder on rows): the skip statement frees it, never the pool's next user.
        held = bool(row["acquired"]) or waited is not None
        return _skip(db, session, claim, scope, held=held, reason=granted, newer=row["newer_slot"])
    lease = Lease(granted, scope, session, row["token"], row["attempts"], lease_seconds)
    if lease_seconds is not None:
        watch(lease)
    return lease


def _acquire_on_rows(db: Database, claim: Claim, lease_seconds: float) -> Lease | Skip:
    """``acquire`` on rows (``RowHold``): one statement, the session given back at once."""
    params = {**claim.params(), "lease_s": lease_seconds}
    sent = time.monotonic()
    session, row = _try_lock(db, "acquire_rows", params, "session", None)
    # Not granted: one more try when the holder was this message's own earlier attempt
    # and it died, or else (as in ``acquire``) when an advisory holder's release may be
    # in flight, sent without waiting, a round trip later.
    if not row["acquired"] and (
        row["own_expires_at"] is None or _own_attempt_died(session, claim, row)
    ):
        session, row = _try_lock(db, "acquire_rows", params, "session", session)
    granted = verdict(claim, row)
    if isinstance(granted, str):  # the row is held only once the slot is claimed: not now
        return _skip(
            db, session, claim, "session", held=False, reason=granted, newer=row["newer_slot"]
        )
    db.lock_sessions.give_back(session, clean=True)
    hold = RowHold(db.lock_sessions, granted.key, row["token"], lease_seconds, sent)
    lease = Lease(granted, "session", hold, row["token"], row["attempts"], lease_seconds)
    watch(lease)
    return lease


def _own_attempt_died(session: LockSession, claim: Claim, refused: Row) -> bool:
    """Whether the row holding ``claim``'s lock, an earlier attempt of this very message
    (``refused``'s ``own_expires_at``), died: a redelivery (``acks_late`` after a SIGKILLed
    pool process) finds it unexpired, since on rows nothing frees a dead holder's lock but
    its lease. Waits while that row lives unrenewed: True once it expired (the attempt
    died, the lock is free), False when it was renewed (the attempt lives: the copy is a
    duplicate)."""
    params = {"keys": list(claim.keys or (claim.key,)), "task_id": claim.task_id}
    deadline = time.monotonic() + refused["own_seconds_left"] + OWN_ATTEMPT_SLACK
    while time.monotonic() < deadline:
        time.sleep(OWN_ATTEMPT_POLL)
        now = session.row("own_row_lock", params)
        if now is None:
            return True
        if now["expires_at"] != refused["own_expires_at"]:
            return False
    return True


def _try_lock(
    db: Database, name: str, params: dict[str, Any], scope: Scope, waited: LockSession | None
) -> tuple[LockSession, Row]:
    # A pooled session may have died while idle (server restart, a DBA's
    # idle_session_timeout): such a failure is retried on the next one. Every pooled
    # session may be dead (each failure discards one), so: the pool's size, plus one.
    attempts = db.pool.max_size + 1
    sessions = db.lock_sessions
    for attempt in range(attempts):
        session = waited if waited is not None else sessions.take()
        try:
            session.use_scope(scope)
            row = session.row(name, params)
            assert row is not None
            return session, row
        except ReadOnlyServer:
            session.close()  # it reaches a standby: the next one may reach the new primary
            sessions.give_back(session, clean=False)
            raise
        except (SessionGone, WaitEnded):  # a DBA's statement_timeout or cancel: retried too
            usable = sessions.give_back(session, clean=False)
            if attempt == attempts - 1 or waited is not None or usable:
                raise
        except BaseException:
            sessions.give_back(session, clean=False)
            raise
    raise AssertionError("unreachable")  # pragma: no cover


def _skip(
    db: Database,
    session: LockSession,
    claim: Claim,
    scope: Scope,
    *,
    held: bool,
    reason: str,
    newer: str | None,
) -> Skip:
    try:
        # any failure an outage (or a misconfiguration): retried
        skip = record_skip(session, claim, reason, held=held, newer_slot=newer, outage=True)
        if scope == "transaction":
            session.commit()
    except DatabaseError:
        db.lock_sessions.give_back(session, clean=False)
        raise
    # Held and then freed: the lease was armed, so let the pool's reset disarm it.
    db.lock_sessions.give_back(session, clean=not held or scope == "transaction")
    return skip


def release(db: Database, lease: Lease, state: str, reason: str | None = None) -> Released:
    """Record the attempt's outcome and free the lock; says if the lock was lost."""
    if lease.lease_seconds is not None:
        unwatch(lease)
    lease.released = True
    if isinstance(lease.lock_session, RowHold):
        return _release_on_rows(db, lease, lease.lock_session, state, reason)
    if lease.shared is not None:
        return _release_shared(db, lease, state, reason)
    if _release_unwaited(db, lease):
        return Released(recorded=False, lost=lease.known_lost)
    session = lease.lock_session
    armed = lease.scope == "session" and db.lease_supported  # the lease is to disarm
    disarm = db.idle_defaults["idle_session_timeout"] if armed else None
    params = release_params(lease, state, reason, disarm)
    try:
        if lease.scope == "session" and session.in_transaction():
            session.rollback()  # the body left it open; the pool would roll back our outcome
        row = session.row("release", params)
        if lease.scope == "transaction":
            session.commit()
    except DatabaseError as exc:
        if isinstance(exc, ReadOnlyServer):
            session.close()  # demoted under us: the lock there is no lock; record it elsewhere
        usable = db.lock_sessions.give_back(session, clean=False)
        # Ended, or cut short: the pool's reset frees the lock; record the outcome elsewhere.
        if not isinstance(exc, (SessionGone, WaitEnded)) and usable:
            raise
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    db.lock_sessions.give_back(session, clean=True)
    return _released(db, lease, state, recorded=bool(row and row["recorded"]))


def _released(db: Database, lease: Lease, state: str, *, recorded: bool) -> Released:
    """A release that went through: a success recorded is recalled (``failover``)."""
    if recorded and state == SUCCEEDED:
        db.recall.remember(lease.claim, lease.token)
    return Released(recorded=recorded, lost=lease.known_lost)


def _release_on_rows(
    db: Database, lease: Lease, hold: RowHold, state: str, reason: str | None
) -> Released:
    """``release`` of a lock on rows: the outcome and the row's deletion in one statement,
    tried again on a fresh connection while PostgreSQL is unreachable (it is idempotent:
    both check the token). Unreachable for too long: the row expires by itself."""
    hold.give_back_lent()
    params = {
        **lease.claim.params(),
        "token": lease.token,
        "state": state,
        "reason": short_reason(reason) if reason else None,
    }
    try:
        row = hold.row("release_rows", params)
    except DatabaseError:
        try:
            row = when_reachable(lease.claim, lambda: _release_fresh(db, params))
        except (DatabaseError, OSError):
            return Released(recorded=False, lost=lease.known_lost)
    assert row is not None
    if not row["held"]:
        lease.mark_lost("the lease ran out before the release: another holder may have run")
    return _released(db, lease, state, recorded=bool(row["recorded"]))


def _release_fresh(db: Database, params: dict[str, Any]) -> Row:
    with db.lock_sessions.fresh() as session:
        row = session.row("release_rows", params)
    assert row is not None
    return row


def _release_shared(db: Database, lease: Lease, state: str, reason: str | None) -> Released:
    """``release`` of a lock on a session the process's runs share (``shared``)."""
    disarm = db.idle_defaults["idle_session_timeout"] if db.lease_supported else None
    params = release_params(lease, state, reason, disarm)
    try:
        row = shared.release(db, lease, params)
    except DatabaseError as exc:  # the session was ended: its locks are free
        lease.mark_lost(f"connection lost before the outcome was recorded: {exc}")
        return Released(recorded=_recover_outcome(db, lease, state, reason), lost=True)
    return _released(db, lease, state, recorded=bool(row["recorded"]))


def _release_unwaited(db: Database, lease: Lease) -> bool:
    """Send a mutex-only release without waiting; False when it must be waited for."""
    if lease.scope != "session" or lease.claim.slot is not None:
        return False  # an outcome to record, or a transaction to commit
    session = lease.lock_session
    disarm = db.idle_defaults["idle_session_timeout"] if db.lease_supported else None
    params = [disarm, application_name()]
    try:
        sent = session.send_unwaited("release_unwaited", params, db.settings.connect_timeout)
    except DatabaseError as exc:
        db.lock_sessions.give_back(session, clean=False)  # closed if broken: lock gone too
        lease.mark_lost(f"connection lost before the lock was released: {exc}")
        return True
    if not sent:
        return False  # the body left a transaction open, or the server spoke (ended it?)
    db.lock_sessions.park(session)
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
    with db.lock_sessions.fresh() as session:
        record_failure_after_rollback(session, lease.claim, lease.token, short_reason(reason))
