"""One server session for the session-scope locks of a process whose tasks run as
threads or greenlets (``pglock_shared_sessions``).

Advisory locks belong to a server session, and one session holds thousands: so every
session-scope lock such a process takes without waiting lives on one shared session (one
per lease length, as the lease is the session's idle timeout), not on a connection per
running task. A worker with ``-P gevent -c 300`` then needs a handful of connections.

- Exclusion inside the process: a session takes again a lock it already holds, so the
  server cannot keep two runs of this process apart; the process does. A key (or a
  slot's own lock) that a run of this process holds is not asked for again: a claim with
  none of its keys left is skipped as ``locked`` at once, its holder named from here.
- Turns: statements on the shared sessions, and the bookkeeping around them, take turns
  (one lock per process); a round trip is short, and a connection carries one statement
  at a time anyway.
- The lease is armed on the session while any run holds a lock on it; the heartbeat's
  ping of one run keeps all of them. A frozen or dead process loses every lock on it, as
  before; a session that ends marks every lease on it lost.
- The last run's release disarms the lease and gives the connection back to the pool,
  whose idle close then returns it to the server.
- A body reading ``self.pglock.connection`` is lent a pooled connection of its own until
  the release: a session-scope lock never shares its connection with other code.

Runs that wait for their lock (``advisory_lock(wait=True)``) and transaction scope keep
one connection per run. The session itself (its connection, ending it, telling its
holders) is the store's: ``celery_pglock.store._shared_sessions``.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import weakref
from datetime import datetime, timezone
from typing import Any

from celery_pglock._heartbeat import watch
from celery_pglock._ledger import holder_application_name, record_skip
from celery_pglock._protocol import Claim, Lease, Skip, verdict
from celery_pglock.errors import DatabaseError
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._database import Database
from celery_pglock.store._lock_sessions import Row
from celery_pglock.store._shared_sessions import SharedSession, SlotLock


@dataclasses.dataclass(frozen=True)
class Held:
    """A lock a run of this process holds on a shared session."""

    lease: Lease
    since: str  # when it was granted (ISO 8601, UTC), for a skip naming its holder


class Sharing:
    """A process's shared sessions for one ``Database``, and the locks its runs hold."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.turn = threading.Lock()
        self._by_lease: dict[str | None, SharedSession] = {}  # by the lease armed on them
        self._keys: dict[int, Held] = {}  # lock key -> the run holding it
        self._slot_locks: dict[tuple[int, int], Held] = {}

    def session_for(self, armed: str | None) -> SharedSession:
        found = self._by_lease.get(armed)
        if found is None:
            found = self._by_lease[armed] = SharedSession(self.db.lock_sessions)
        return found

    def holder(self, claim: Claim, slot: SlotLock) -> Held | None:
        """The run of this process that keeps ``claim`` from running now, if any: it
        holds the claim's slot lock, or every one of its keys."""
        if slot is not None and slot in self._slot_locks:
            return self._slot_locks[slot]
        keys = claim.keys or (claim.key,)
        held = [self._keys[key] for key in keys if key in self._keys]
        return held[0] if len(held) == len(keys) else None

    def free_keys(self, claim: Claim) -> list[int]:
        keys = [key for key in claim.keys or (claim.key,) if key not in self._keys]
        # One key left of several: given twice, so that the lock statement still takes
        # the slot's own lock first (``try_lock_any`` runs for more than one key).
        return keys * 2 if claim.keys and len(keys) == 1 else keys

    def hold(self, lease: Lease, shared: SharedSession, slot: SlotLock) -> None:
        held = Held(lease, datetime.now(timezone.utc).isoformat())
        shared.holders[id(lease)] = lease.mark_lost
        self._keys[lease.claim.key] = held
        if slot is not None:
            self._slot_locks[slot] = held

    def forget(self, lease: Lease, shared: SharedSession, slot: SlotLock) -> None:
        shared.holders.pop(id(lease), None)
        if (found := self._keys.get(lease.claim.key)) and found.lease is lease:
            del self._keys[lease.claim.key]
        if slot is not None and (found := self._slot_locks.get(slot)) and found.lease is lease:
            del self._slot_locks[slot]


# A database's sharing, made on first use; forgotten with the database (after a fork).
_sharings: weakref.WeakKeyDictionary[Database, Sharing] = weakref.WeakKeyDictionary()
_sharings_lock = threading.Lock()


def sharing_of(db: Database) -> Sharing:
    """``db``'s shared sessions (created on first use; the lock is taken only then)."""
    found = _sharings.get(db)
    if found is None:
        with _sharings_lock:
            found = _sharings.get(db)
            if found is None:
                found = _sharings[db] = Sharing(db)
    return found


def label() -> str:
    """What ``pg_stat_activity`` shows for a shared session: its process, no task."""
    return holder_application_name(None, os.getpid(), HOSTNAME)


def acquire(
    db: Database, claim: Claim, name: str, params: dict[str, Any], lease_seconds: float | None
) -> Lease | Skip:
    """``locks.acquire`` on a shared session: statement ``name`` with ``params`` as it made them."""
    sharing = sharing_of(db)
    slot = claim.slot_lock
    with sharing.turn:
        shared = sharing.session_for(params["lease_ms"])
        holder = sharing.holder(claim, slot)
        if holder is not None:
            return _skip(shared, claim, "locked", None, holder=holder)
        keys = sharing.free_keys(claim)
        params = {**params, "keys": keys, "application_name": label()}
        try:
            session, row = shared.row(name, params)
            # A holder elsewhere may have just ended: one more try, as locks.acquire does.
            if not row["acquired"]:
                session, row = shared.row(name, params)
        except DatabaseError:
            # Cut short (a DBA's statement_timeout, say): a lock it took before failing
            # outlives the statement on a session that lives on.
            shared.unlock(keys, slot)
            raise
        granted = verdict(claim, row)
        if isinstance(granted, str):
            if row["acquired"]:  # the slot is done, superseded or late: free what it took
                shared.unlock([row["key"]], slot)
            return _skip(shared, claim, granted, row["newer_slot"], holder=None)
        token, attempts = row["token"], row["attempts"]
        lease = Lease(granted, "session", session, token, attempts, lease_seconds, shared=shared)
        sharing.hold(lease, shared, slot)
        if lease_seconds is not None:
            watch(lease)
        return lease


def _skip(
    shared: SharedSession, claim: Claim, reason: str, newer_slot: str | None, *, holder: Held | None
) -> Skip:
    """Log the skip on the session (turn held). The look-up names holders of other
    sessions only: a run of this process holding the lock is named from here."""
    session = shared.session()
    try:
        local = holder.lease.claim.task_id if holder is not None else None
        skip = record_skip(
            session, claim, reason, held=False, newer_slot=newer_slot, local_holder=local
        )
    except BaseException as exc:
        shared.end_if_unusable(session, exc)
        raise
    finally:
        shared.give_back(disarmed=False)
    if holder is not None and skip.reason == "locked" and skip.holder is None:
        claimed = holder.lease.claim
        named = {
            "host": claimed.host,
            "pid": claimed.pid or os.getpid(),
            "task_id": claimed.task_id,
        }
        named |= {"since": holder.since, "slot": claimed.slot}
        skip = dataclasses.replace(skip, holder=named, token=holder.lease.token)
    return skip


def release(db: Database, lease: Lease, params: dict[str, Any]) -> Row:
    """``locks.release`` on a shared session: record the outcome and free this run's lock
    only. The last run on the session disarms its lease and gives its connection back.

    Any failure ends the session: a lock whose release did not go through must not stay
    held by a session that lives on. The caller then records the outcome elsewhere, if
    it still can.
    """
    sharing = sharing_of(db)
    shared = lease.shared
    assert isinstance(shared, SharedSession)
    lent, lease.lent = lease.lent, None
    if lent is not None:  # the body's own: reset (its transaction, its own locks) and back
        shared.give_back_lent(lent)
    slot = lease.claim.slot_lock
    with sharing.turn:
        last = len(shared.holders) == 1
        params = {
            **params,
            "held_key": lease.claim.key,  # and its slot lock (``slot_lock``), if any
            "disarm_ms": params["disarm_ms"] if last else None,
            "idle_application_name": params["idle_application_name"] if last else None,
        }
        try:
            row = shared.release(lease.lock_session, params)
        finally:
            sharing.forget(lease, shared, slot)
        shared.give_back(disarmed=True)
    return row
