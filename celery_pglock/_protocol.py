"""The types the locking protocol passes between its steps, in the order of a run.

``Claim``: one attempt to run under a lock (what is locked, for which slot, who asks).
``acquire`` answers with a ``Lease`` (granted: the task's ``self.pglock``) or a ``Skip``
(why not, and who holds the lock or ran the slot); ``release`` with a ``Released``.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from celery_pglock import signals
from celery_pglock._keys import slot_lock, split_key
from celery_pglock._slots import SLOT_PATTERN, is_time_slot
from celery_pglock._values import Scope
from celery_pglock.errors import DatabaseError, LockLost, PgLockError, SessionGone
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.store._driver import Connection
from celery_pglock.store._lock_sessions import LockSession
from celery_pglock.store._shared_sessions import SharedSession

logger = logging.getLogger("celery_pglock")


@dataclass(frozen=True)
class Claim:
    """One attempt to run under a lock: what is locked and who asks.

    ``coalesce``: skip (``superseded``) when a newer time slot of the lock (and of the same
    beat ``entry``, when known) already succeeded or is running. ``max_lateness``: skip
    (``late``) a time slot older than that many seconds. Neither applies to other slots.
    """

    lock_name: str
    key: int
    slot: str | None
    task_id: str | None
    task_name: str | None
    host: str = HOSTNAME
    pid: int = 0
    entry: str | None = None
    coalesce: bool = False
    max_lateness: float | None = None
    # pglock_concurrency > 1: the lock name's keys (``keys.lock_keys``), ``key`` first;
    # a granted claim's ``key`` is the one it got.
    keys: tuple[int, ...] = ()
    # pglock_overlap = "buffer_one": a message that finds the lock held waits its turn
    # (``waiting``) instead of being skipped as ``locked``.
    buffer: bool = False
    # pglock_overlap = "allow": ``key`` is the slot's own (``keys.slot_key``), so that only
    # copies of this slot exclude each other; holders record concurrency 0 ("per slot").
    per_slot: bool = False

    @property
    def concurrency(self) -> int:
        return len(self.keys) or 1

    @property
    def slot_lock(self) -> tuple[int, int] | None:
        """The slot's own lock, taken first under ``pglock_concurrency`` (``try_lock_any``):
        two messages of one slot never run at once under two of the lock name's keys."""
        return slot_lock(self.lock_name, self.slot) if self.keys and self.slot else None

    def params(self) -> dict[str, Any]:
        classid, objid = split_key(self.key)
        timed = is_time_slot(self.slot)
        return {
            **self._identity(classid, objid),
            "keys": list(self.keys or (self.key,)),
            "concurrency": 0 if self.per_slot else self.concurrency,
            "buffer": self.buffer,
            "slot_lock": list(self.slot_lock) if self.slot_lock else None,
            "entry": self.entry,
            "newer_than": self.slot if self.coalesce and timed else None,
            "slot_pattern": SLOT_PATTERN,
            "slot_time": self.slot if self.max_lateness is not None and timed else None,
            "max_lateness": self.max_lateness,
        }

    def _identity(self, classid: int, objid: int) -> dict[str, Any]:
        return {
            "lock_name": self.lock_name,
            "key": self.key,
            "slot": self.slot,
            "task_id": self.task_id,
            "task_name": self.task_name,
            "host": self.host,
            "pid": self.pid or os.getpid(),
            "classid": classid,
            "objid": objid,
        }


def verdict(claim: Claim, row: Mapping[str, Any]) -> Claim | str:
    """What the row of an ``acquire`` statement means for ``claim``: the claim as granted
    (with the key it got, under ``pglock_concurrency``), or why it is skipped. A lock
    granted for a slot that was not claimed (done, superseded, late) is a skip too."""
    if row["acquired"] and (claim.slot is None or row["attempts"] is not None):
        return claim if row["key"] == claim.key else replace(claim, key=row["key"])
    return "superseded" if row["newer_slot"] else "late" if row["late"] else "locked"


@dataclass(frozen=True)
class Skip:
    """Why a message did not run, with who holds the lock or ran the slot."""

    reason: str
    lock_name: str
    slot: str | None
    holder: dict[str, Any] | None
    token: int | None

    def meta(self) -> dict[str, Any]:
        """What the result backend stores for the ``SKIPPED`` state (JSON-serializable)."""
        return {
            "reason": self.reason,
            "lock": self.lock_name,
            "slot": self.slot,
            "holder": self.holder,
            "token": self.token,
        }

    @property
    def lock(self) -> str:
        """Deprecated (0.2): ``lock_name``, as a ``Claim`` names it."""
        warnings.warn(
            "Skip.lock is deprecated, use Skip.lock_name", DeprecationWarning, stacklevel=2
        )
        return self.lock_name


@dataclass
class Lease:
    """A granted lock: what the task sees as ``self.pglock``."""

    claim: Claim
    scope: Scope
    lock_session: LockSession  # the server session that holds the lock
    token: int
    attempts: int | None
    lease_seconds: float | None  # the server-enforced lease; None: off
    lost_cause: str | None = None
    last_ping: float = field(default_factory=time.monotonic)
    # When the server last answered on the lock's connection (the grant, a ping, a check).
    confirmed: float = field(default_factory=time.monotonic)
    released: bool = False  # release began: the heartbeat must not use the connection
    # Set when ``lock_session`` is shared by the process's runs (``shared``): the body then
    # gets a session of its own (``lent``), never the shared one.
    shared: SharedSession | None = None
    lent: LockSession | None = None

    @property
    def lock(self) -> str:
        return self.claim.lock_name

    @property
    def lock_connection(self) -> Connection:
        """The driver's connection of ``lock_session``."""
        return self.lock_session.driver

    @property
    def connection(self) -> Connection:
        """The lock's connection, for the body: in transaction scope inside the lock's
        transaction. A lock on a shared session lends the body a connection of its own
        (a session-scope lock never shares its connection with other code)."""
        if self.shared is None:
            return self.lock_connection
        if self.released:  # lent now, nothing would give it back
            raise PgLockError(f"lock {self.lock!r} was released: its run has no connection")
        if self.lent is None:
            self.lent = self.shared.lend()
        return self.lent.driver

    @property
    def session(self) -> Connection:
        """Deprecated (0.2): ``lock_connection``; the body's is ``connection``."""
        warnings.warn(
            "Lease.session is deprecated, use Lease.lock_connection",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.lock_connection

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
        seconds = self.lease_seconds
        return seconds is not None and time.monotonic() - self.confirmed > seconds / 2

    def ask_server(self) -> None:
        """One round trip on the lock connection: marks the lease lost if the session ended."""
        # The caller's thread is not using the connection (it is the body's own, or the
        # body's thread is the caller), so waiting for its lock waits only for a ping.
        try:
            self.lock_session.ping()
        except DatabaseError as exc:
            judge_failure(self, exc)
        else:
            self.confirmed = time.monotonic()
            if self.shared is not None:
                self.shared.answered = self.confirmed

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


def judge_failure(lease: Lease, exc: DatabaseError) -> None:
    """Mark ``lease`` lost if ``exc``, raised on its connection, means the session ended.
    Otherwise (e.g. the task's transaction is aborted) the session and the lock live on."""
    if lease.released:  # released meanwhile: the connection is no longer the lease's
        return
    if isinstance(exc, SessionGone):
        lease.mark_lost(exc.cause)


@dataclass(frozen=True)
class Released:
    """How a release went: the outcome recorded, the lock lost before it."""

    recorded: bool
    lost: bool
