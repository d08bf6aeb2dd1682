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
one connection per run.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from datetime import datetime, timezone
from typing import Any

from celery_pglock.errors import DatabaseError, PgLockError, ReadOnlyServer, SessionGone
from celery_pglock.heartbeat import watch
from celery_pglock.ledger import holder_application_name, record_skip
from celery_pglock.protocol import Claim, Lease, Skip, verdict
from celery_pglock.store.connections import HOSTNAME, close_quietly, cut_off
from celery_pglock.store.database import Database
from celery_pglock.store.driver import Connection, dict_rows
from celery_pglock.store.failures import boundary
from celery_pglock.store.lock_sessions import DriverSession

SlotLock = tuple[int, int] | None


class SharedConnection:
    """One shared server session and the leases of the runs holding a lock on it."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self.conn: Connection | None = None
        self.leases: dict[int, Lease] = {}
        self.answered = 0.0  # when the server last answered on it (time.monotonic)

    def lend(self, lease: Lease) -> Connection:
        """A pooled connection for ``lease``'s body, given back at its release."""
        if lease.released:  # lent now, nothing would give it back
            raise PgLockError(f"lock {lease.lock!r} was released: its run has no connection")
        if lease.lent is None:
            lease.lent = self._db.getconn()
        return lease.lent


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
        self._by_lease: dict[str | None, SharedConnection] = {}  # by the lease armed on them
        self._keys: dict[int, Held] = {}  # lock key -> the run holding it
        self._slot_locks: dict[tuple[int, int], Held] = {}

    def connection_for(self, armed: str | None) -> SharedConnection:
        found = self._by_lease.get(armed)
        if found is None:
            found = self._by_lease[armed] = SharedConnection(self.db)
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

    def hold(self, lease: Lease, shared_conn: SharedConnection, slot: SlotLock) -> None:
        held = Held(lease, datetime.now(timezone.utc).isoformat())
        shared_conn.leases[id(lease)] = lease
        self._keys[lease.claim.key] = held
        if slot is not None:
            self._slot_locks[slot] = held

    def forget(self, lease: Lease, shared_conn: SharedConnection, slot: SlotLock) -> None:
        shared_conn.leases.pop(id(lease), None)
        if (found := self._keys.get(lease.claim.key)) and found.lease is lease:
            del self._keys[lease.claim.key]
        if slot is not None and (found := self._slot_locks.get(slot)) and found.lease is lease:
            del self._slot_locks[slot]

    def connect(self, shared_conn: SharedConnection) -> Connection:
        """The session's connection, taken from the pool if it has none (turn held)."""
        if shared_conn.conn is None:
            conn = self.db.getconn()
            if not conn.autocommit:  # a transaction-scope run gave it back idle
                conn.autocommit = True
            shared_conn.conn = conn
        return shared_conn.conn

    def drop(self, shared_conn: SharedConnection, cause: str) -> None:
        """End the session (it ended, reaches a standby, or its state is unknown after an
        interrupted statement): every lock on it is lost, none is left behind."""
        conn, shared_conn.conn = shared_conn.conn, None
        if conn is not None:
            close_quietly(conn)  # its session ends: the server frees whatever it held
            self.db.putconn(conn, clean=False)  # closed: the pool forgets it
        lost, shared_conn.leases = list(shared_conn.leases.values()), {}
        for lease in lost:  # their keys stay taken here until each run's release
            lease.mark_lost(cause)

    def drop_if_unusable(
        self, shared_conn: SharedConnection, conn: Connection, exc: BaseException
    ) -> None:
        """After ``exc`` on the session's ``conn``: end the session if it is gone, reaches a
        server that takes no writes (a demoted primary: the next session may reach the new
        one), or was cut off mid-statement (its state, locks included, is unknown)."""
        if isinstance(exc, (SessionGone, ReadOnlyServer)):
            self.drop(shared_conn, f"the shared session ended: {exc.cause or exc}")
        elif cut_off(conn):
            self.drop(shared_conn, "a statement on the shared session was cut off")

    def unlock(self, shared_conn: SharedConnection, keys: list[int], slot: SlotLock) -> None:
        """Free ``keys`` and ``slot`` on the session, which no run of the process holds
        (turn held); if that fails, end the session rather than leave them held."""
        conn = shared_conn.conn
        if conn is None:
            return  # ended: nothing of it is held any more
        params = {"keys": sorted(set(keys)), "slot_lock": list(slot) if slot else None}
        try:
            with boundary(self.db.settings, conn):
                conn.execute(self.db.tables.query("unlock_shared"), params)
        except DatabaseError as exc:
            self.drop(shared_conn, f"freeing a lock on the shared session failed: {exc}")
        except BaseException:
            self.drop(shared_conn, "freeing a lock on the shared session was cut off")
            raise

    def give_back(self, shared_conn: SharedConnection, *, disarmed: bool) -> None:
        """Return an unused session's connection to the pool (turn held). ``disarmed``:
        the last release put the lease and the label back; else (a skip's try may have
        armed them) the pool's reset does."""
        if shared_conn.leases or shared_conn.conn is None:
            return
        conn, shared_conn.conn = shared_conn.conn, None
        self.db.putconn(conn, clean=disarmed)

    def execute(
        self, shared_conn: SharedConnection, query: bytes, params: Any
    ) -> tuple[Connection, dict[str, Any]]:
        """Run ``query`` on the session (turn held). A session found ended is dropped
        and the statement tried once more, on a new one."""
        for attempt in range(2):
            conn = self.connect(shared_conn)
            try:
                with boundary(self.db.settings, conn), conn.cursor(row_factory=dict_rows) as cur:
                    row = cur.execute(query, params).fetchone()
            except SessionGone as exc:
                self.drop(shared_conn, f"the shared session ended: {exc.cause or exc}")
                if attempt:
                    raise
                continue
            except BaseException as exc:
                self.drop_if_unusable(shared_conn, conn, exc)
                raise
            assert row is not None
            shared_conn.answered = time.monotonic()
            return conn, row
        raise AssertionError("unreachable")  # pragma: no cover


def sharing_of(db: Database) -> Sharing:
    """``db``'s shared sessions (created on first use; the lock is taken only then)."""
    found = db.sharing
    if found is None:
        with db.shared_lock:
            if db.sharing is None:
                db.sharing = Sharing(db)
            found = db.sharing
    assert isinstance(found, Sharing)
    return found


def label() -> str:
    """What ``pg_stat_activity`` shows for a shared session: its process, no task."""
    return holder_application_name(None, os.getpid(), HOSTNAME)


def acquire(
    db: Database, claim: Claim, query: bytes, params: dict[str, Any], lease_seconds: float | None
) -> Lease | Skip:
    """``locks.acquire`` on a shared session: ``query`` and its ``params`` as it made them."""
    sharing = sharing_of(db)
    slot = claim.slot_lock
    with sharing.turn:
        shared_conn = sharing.connection_for(params["lease_ms"])
        holder = sharing.holder(claim, slot)
        if holder is not None:
            return _skip(sharing, shared_conn, claim, "locked", None, holder=holder)
        keys = sharing.free_keys(claim)
        params = {**params, "keys": keys, "application_name": label()}
        try:
            conn, row = sharing.execute(shared_conn, query, params)
            # A holder elsewhere may have just ended: one more try, as locks.acquire does.
            if not row["acquired"]:
                conn, row = sharing.execute(shared_conn, query, params)
        except DatabaseError:
            # Cut short (a DBA's statement_timeout, say): a lock it took before failing
            # outlives the statement on a session that lives on.
            sharing.unlock(shared_conn, keys, slot)
            raise
        granted = verdict(claim, row)
        if isinstance(granted, str):
            if row["acquired"]:  # the slot is done, superseded or late: free what it took
                sharing.unlock(shared_conn, [row["key"]], slot)
            return _skip(sharing, shared_conn, claim, granted, row["newer_slot"], holder=None)
        session = DriverSession(conn, sharing.db.settings)
        token, attempts = row["token"], row["attempts"]
        lease = Lease(
            granted, "session", session, token, attempts, lease_seconds, shared=shared_conn
        )
        sharing.hold(lease, shared_conn, slot)
        if lease_seconds is not None:
            watch(lease)
        return lease


def _skip(
    sharing: Sharing,
    shared_conn: SharedConnection,
    claim: Claim,
    reason: str,
    newer_slot: str | None,
    *,
    holder: Held | None,
) -> Skip:
    """Log the skip on the session (turn held). The look-up names holders of other
    sessions only: a run of this process holding the lock is named from here."""
    conn = sharing.connect(shared_conn)
    try:
        session = DriverSession(conn, sharing.db.settings)
        local = holder.lease.claim.task_id if holder is not None else None
        skip = record_skip(
            session, claim, reason, held=False, newer_slot=newer_slot, local_holder=local
        )
    except BaseException as exc:
        sharing.drop_if_unusable(shared_conn, conn, exc)
        raise
    finally:
        sharing.give_back(shared_conn, disarmed=False)
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


def release(db: Database, lease: Lease, query: bytes, params: dict[str, Any]) -> tuple[Any, ...]:
    """``locks.release`` on a shared session: record the outcome and free this run's lock
    only. The last run on the session disarms its lease and gives its connection back.

    Any failure ends the session (``drop``): a lock whose release did not go through
    must not stay held by a session that lives on. The caller then records the outcome
    elsewhere, if it still can.
    """
    sharing = sharing_of(db)
    shared_conn = lease.shared
    assert isinstance(shared_conn, SharedConnection)
    lent, lease.lent = lease.lent, None
    if lent is not None:  # the body's own: reset (its transaction, its own locks) and back
        db.putconn(lent, clean=False)
    slot = lease.claim.slot_lock
    with sharing.turn:
        last = len(shared_conn.leases) == 1
        params = {
            **params,
            "held_key": lease.claim.key,  # and its slot lock (``slot_lock``), if any
            "disarm_ms": params["disarm_ms"] if last else None,
            "idle_application_name": params["idle_application_name"] if last else None,
        }
        conn = lease.lock_connection
        try:
            if conn is not shared_conn.conn:
                raise SessionGone("the shared session ended before the release")
            with boundary(db.settings, conn):
                row = conn.execute(query, params).fetchone()
        except BaseException as exc:
            if conn is shared_conn.conn:
                cause = exc.cause if isinstance(exc, DatabaseError) and exc.cause else exc
                sharing.drop(shared_conn, f"the release failed on the shared session: {cause}")
            raise
        finally:
            sharing.forget(lease, shared_conn, slot)
        shared_conn.answered = time.monotonic()
        sharing.give_back(shared_conn, disarmed=True)
    assert row is not None
    return tuple(row)
