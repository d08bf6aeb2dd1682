"""A server session whose locks several runs of the process hold (``pglock_shared_sessions``).

Advisory locks belong to a server session, and one session holds thousands, so a process
whose tasks run as threads or greenlets keeps its session-scope locks on one
``SharedSession`` (one per lease length: the lease is the session's idle timeout). This
module owns that session's connection: it takes one from the database's lock sessions
when a statement needs it, gives it back once no run holds a lock on it, and ends it
whenever its state is in doubt, telling every holder that its lock is gone. Which run
holds which lock is the process's bookkeeping, above the store (``celery_pglock._shared``).

The caller takes turns (one statement at a time per process): nothing here locks.
Built only on ``LockSessions``, so the in-memory twin shares sessions the same way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from celery_pglock.errors import DatabaseError, ReadOnlyServer, SessionGone
from celery_pglock.store._lock_sessions import LockSession, LockSessions, Params, Row

SlotLock = tuple[int, int] | None


class SharedSession:
    """One server session and the runs holding a lock on it."""

    def __init__(self, sessions: LockSessions) -> None:
        self._sessions = sessions
        self._current: LockSession | None = None
        # A run holding a lock here, by its id: what to call when the session ends.
        self.holders: dict[int, Callable[[str], None]] = {}
        self.answered = 0.0  # when the server last answered on it (time.monotonic)

    def lend(self) -> LockSession:
        """A pooled session of its own for a run's body: given back with ``give_back_lent``."""
        return self._sessions.take()

    def give_back_lent(self, lent: LockSession) -> None:
        self._sessions.give_back(lent, clean=False)  # reset: its transaction, its own locks

    def session(self) -> LockSession:
        """The session, taken from the lock sessions if it has none."""
        if self._current is None:
            session = self._sessions.take()
            session.use_scope("session")  # a transaction-scope run may have given it back
            self._current = session
        return self._current

    def row(self, name: str, params: Params) -> tuple[LockSession, Row]:
        """Statement ``name``'s row on the session, and the session it ran on. A session
        found ended is dropped and the statement tried once more, on a new one."""
        for attempt in range(2):
            session = self.session()
            try:
                row = session.row(name, params)
            except SessionGone as exc:
                self.end(f"the shared session ended: {exc.cause or exc}")
                if attempt:
                    raise
                continue
            except BaseException as exc:
                self.end_if_unusable(session, exc)
                raise
            assert row is not None
            self.answered = time.monotonic()
            return session, row
        raise AssertionError("unreachable")  # pragma: no cover

    def release(self, held_on: LockSession, params: Params) -> Row:
        """The ``release`` statement of one run's lock, held on ``held_on``. Any failure ends
        the session: a lock whose release did not go through must not stay held by a
        session that lives on."""
        try:
            if held_on is not self._current:
                raise SessionGone("the shared session ended before the release")
            row = held_on.row("release", params)
        except BaseException as exc:
            if held_on is self._current:
                cause = exc.cause if isinstance(exc, DatabaseError) and exc.cause else exc
                self.end(f"the release failed on the shared session: {cause}")
            raise
        assert row is not None
        self.answered = time.monotonic()
        return row

    def unlock(self, keys: Sequence[int], slot: SlotLock) -> None:
        """Free ``keys`` and ``slot``, which no run holds; if that fails, end the session
        rather than leave them held."""
        session = self._current
        if session is None:
            return  # ended: nothing of it is held any more
        params = {"keys": sorted(set(keys)), "slot_lock": list(slot) if slot else None}
        try:
            session.row("unlock_shared", params)
        except DatabaseError as exc:
            self.end(f"freeing a lock on the shared session failed: {exc}")
        except BaseException:
            self.end("freeing a lock on the shared session was cut off")
            raise

    def end(self, cause: str) -> None:
        """End the session (it ended, reaches a standby, or its state is unknown after an
        interrupted statement): every lock on it is lost, none is left behind."""
        session, self._current = self._current, None
        if session is not None:
            session.close()  # its session ends: the server frees whatever it held
            self._sessions.give_back(session, clean=False)  # closed: the pool forgets it
        lost, self.holders = list(self.holders.values()), {}
        for mark_lost in lost:  # their keys stay taken above until each run's release
            mark_lost(cause)

    def end_if_unusable(self, session: LockSession, exc: BaseException) -> None:
        """After ``exc`` on ``session``: end it if it is gone, reaches a server that takes
        no writes (a demoted primary: the next session may reach the new one), or was cut
        off mid-statement (its state, locks included, is unknown)."""
        if isinstance(exc, (SessionGone, ReadOnlyServer)):
            self.end(f"the shared session ended: {exc.cause or exc}")
        elif session.closed or session.in_transaction():
            self.end("a statement on the shared session was cut off")

    def give_back(self, *, disarmed: bool) -> None:
        """Return the session's connection once no run holds a lock on it. ``disarmed``:
        the last release put the lease and the label back; else (a skip's try may have
        armed them) the pool's reset does."""
        if self.holders or self._current is None:
            return
        session, self._current = self._current, None
        self._sessions.give_back(session, clean=disarmed)
