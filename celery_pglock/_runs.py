"""One run under a lock, from its grant to its settled outcome: the lifecycle that every
holder shares (a locked task, ``advisory_lock`` / ``run_once``, ``celery-pglock run``).

A run is claimed with ``locks.acquire`` (a ``Lease``, or the ``Skip`` why not), holds the
lock while its body runs, and is settled once:

- ``settle_success``: the outcome recorded and the lock freed in one round trip. The run
  learns when its outcome could not stand: in transaction scope a lost lock means the
  body's writes rolled back with it; with a slot, a newer attempt may have taken the slot
  over. Both raise ``LockLost``.
- ``settle_failure``: the failed attempt recorded, whatever state the lock's connection is
  in. In transaction scope the claim rolled back with the body, so the attempt is written
  again after the rollback; when the lock's own connection died (a server restart, a
  pooler's crash), on a fresh connection. It never raises: the body's error matters more.
"""

from __future__ import annotations

import logging

from celery_pglock._heartbeat import unwatch
from celery_pglock._ledger import FAILED, SUCCEEDED, record_failure_after_rollback
from celery_pglock._locks import release
from celery_pglock._protocol import Lease
from celery_pglock.errors import LockLost, SessionGone
from celery_pglock.store._database import Database

logger = logging.getLogger("celery_pglock")


def settle_success(db: Database, lease: Lease, reason: str | None = None) -> None:
    """Record the run ``succeeded`` (with ``reason``, e.g. a skip the body decided) and
    free its lock; ``LockLost`` when that outcome could not stand."""
    released = release(db, lease, SUCCEEDED, reason)
    if not released.lost:
        return
    if lease.scope == "transaction":
        raise LockLost(
            f"lock {lease.lock!r} (token {lease.token}) was lost before its transaction "
            f"committed, so the run's writes were rolled back: {lease.lost_cause}"
        )
    if lease.slot is not None and not released.recorded:
        raise LockLost(
            f"lock {lease.lock!r} for slot {lease.slot!r} was lost before this run (token "
            f"{lease.token}) could record its outcome: {lease.lost_cause}"
        )


def settle_failure(db: Database, lease: Lease, exc: BaseException) -> None:
    """Record the run ``failed`` with ``exc`` and free its lock; never raises."""
    reason = f"{type(exc).__name__}: {exc}"
    try:
        if lease.scope == "session":
            release(db, lease, FAILED, reason)
        else:
            _record_transaction_failure(db, lease, reason)
    except Exception:  # the body's exception matters more than the bookkeeping's
        logger.exception(
            "could not record the failure of %r",
            lease.lock,
            extra={"action": "pglock_failure_not_recorded", "lock": lease.lock},
        )
    finally:
        if lease.scope == "transaction":
            give_back_failed(db, lease)


def _record_transaction_failure(db: Database, lease: Lease, reason: str) -> None:
    """The body failed: its claim rolls back with it; record the failed attempt. When the
    lock's connection itself died, on a fresh one: the rollback on the dead one raises,
    and the slot's row would stay as it was for good."""
    session = lease.lock_session
    try:
        session.rollback()
    except SessionGone:  # behind PgBouncer a dead server can answer InternalError, alike
        with db.lock_sessions.fresh() as fresh:
            record_failure_after_rollback(fresh, lease.claim, lease.token, reason)
        return
    record_failure_after_rollback(session, lease.claim, lease.token, reason)


def give_back_failed(db: Database, lease: Lease) -> None:
    """Give the connection back after the body's transaction failed (transaction scope):
    the heartbeat stops, and the pool's reset frees whatever locks the body took."""
    if lease.lease_seconds is not None:
        unwatch(lease)
    db.lock_sessions.give_back(lease.lock_session, clean=False)


__all__ = ["give_back_failed", "settle_failure", "settle_success"]
