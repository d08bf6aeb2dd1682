"""The heartbeat: one thread per process pings every active lease at a third of its
length, so that a live holder's lock connection never goes idle for a whole lease.

A holder that stops responding (SIGSTOP, GC pause, partition) goes idle, the server ends
its session and so frees its lock; on waking, its next ping fails and the lease is marked
lost. Outside a worker the thread ends with its last lease (``unwatch``).
"""

from __future__ import annotations

import os
import threading
import time

from celery_pglock._protocol import Lease, judge_failure
from celery_pglock.errors import DatabaseError
from celery_pglock.store._database import serving_tasks

MIN_PING_INTERVAL = 0.2
# An idle heartbeat thread still wakes this often (seconds), so that registering a lease
# whose pings are further apart never has to wake it.
IDLE_WAKE = 5.0
# How long ending the heartbeat thread waits for a ping in flight (seconds).
HEARTBEAT_STOP_WAIT = 2.0


def ping(lease: Lease) -> None:
    """One heartbeat; marks the lease lost if the server ended the session."""
    session = lease.lock_session
    shared = lease.shared
    # A shared session that answered lately (another run's statement or ping) is not
    # idle either: one ping keeps all of its runs' locks.
    if shared is not None and time.monotonic() - shared.answered < _interval(lease) / 2:
        lease.last_ping = lease.confirmed = shared.answered
        return
    # Never wait behind the task's own query (transaction scope): a busy connection is
    # not idle, so the server will not end it.
    if lease.released or session.busy():
        lease.last_ping = time.monotonic()  # busy, so not idle: next ping in one interval
        return
    try:
        session.ping()
        lease.last_ping = lease.confirmed = time.monotonic()
        if shared is not None:
            shared.answered = lease.confirmed
    except DatabaseError as exc:
        judge_failure(lease, exc)
        # Not lost (a lock on rows whose renewal failed with time left): try again in a
        # third of the interval, not at once (a retry loop while PostgreSQL is away).
        lease.last_ping = time.monotonic() - _interval(lease) * 2 / 3


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
    return max(MIN_PING_INTERVAL, (lease.lease_seconds or 60.0) / 3)


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
