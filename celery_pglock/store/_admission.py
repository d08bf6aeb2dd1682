"""Admission: when a process may open one more connection to the server.

A process never takes the server's last ``pglock_spare_connections`` slots: each new
connection asks how many are free (``check``), and the answer sets how many the process may
open at once (``note_headroom``: half of them, at most ``MAX_OPENING``; one at a time near
the limit, so that every check counts the connections of ours). Through a pooler or a proxy
the server's slots are not ours to count; the pooler's own limits decide.

The server full (``too many clients``, a role's limit, a pooler's ``max_client_conn``, or
fewer free slots than the spare ones) is a pause, not a failure, while the process holds
connections that will come back: it opens no other one for ``FULL_PAUSE`` seconds
(``refused``). The pool's lock guards this state: ``Admission`` takes it only in
``note_headroom``, the one call from outside the pool.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from celery_pglock._config import Settings
from celery_pglock.errors import ServerFull
from celery_pglock.schema import statement
from celery_pglock.store._driver import Connection
from celery_pglock.store._failures import boundary

FULL_PAUSE = 1.0  # after the server refused a connection: wait for ours meanwhile
RETRY_FULL = 0.2  # holding none, how often to try again while the server is full
MAX_OPENING = 16  # connections a process opens at once, far from the server's limit


class Admission:
    """What the server last said about room for this process's connections."""

    def __init__(self, guard: threading.Lock) -> None:
        self._guard = guard  # the pool's lock
        self.opening = 0  # connections being opened (the pool counts them in its size)
        self.headroom = 0  # free server slots beyond the spare ones, as last seen
        self.full_until = 0.0
        self.full_reason: ServerFull | None = None

    def note_headroom(self, slots: int | None) -> None:
        """The server's free slots beyond those left to others, seen by a new connection.
        None: not the server's slots to count (a pooler in between), ``MAX_OPENING`` at
        once."""
        with self._guard:
            self.headroom = 2 * MAX_OPENING if slots is None else slots

    def may_open(self, size: int) -> bool:
        """Whether one more may be opened beside the ``size`` held (cap aside): the
        server not refusing lately while some of ours will come back, and few enough
        being opened at once."""
        if size and time.monotonic() < self.full_until:
            return False  # the server refused lately: wait for one of ours meanwhile
        return self.opening < max(1, min(MAX_OPENING, self.headroom // 2))

    def refused(self, full: ServerFull) -> None:
        """The server refused a connection: open none for a moment."""
        self.full_reason = full
        self.full_until = time.monotonic() + FULL_PAUSE

    def refusal_within(self, seconds: float) -> ServerFull | None:
        """The server's refusal, if it came less than ``seconds`` after its pause."""
        if self.full_reason is not None and time.monotonic() < self.full_until + seconds:
            return self.full_reason
        return None


def check(conn: Connection, settings: Settings, admission: Admission) -> None:
    """Admit the new ``conn``, or refuse it (``ServerFull``) when fewer than
    ``pglock_spare_connections`` server slots remain; note the headroom either way."""
    spare = settings.spare_connections
    if not spare:
        return
    with boundary(settings):
        row = conn.execute(statement("free_connection_slots")).fetchone()
    assert row is not None
    free, client_port = row
    if not server_sees_own_socket(conn, client_port):
        admission.note_headroom(None)
        return
    admission.note_headroom(free - spare)
    if free < spare:
        raise ServerFull(
            f"PostgreSQL has {max(free, 0)} connection slots left, fewer than "
            f"pglock_spare_connections ({spare}), left to other clients"
        )


def server_sees_own_socket(conn: Connection, client_port: int | None) -> bool:
    """Whether the server's client is ``conn``'s own socket: ``client_port`` (what the
    server sees, None over a Unix socket) is the port of ``conn``'s end. A pooler or a
    proxy in between (PgBouncer, HAProxy) connects with sockets of its own."""
    with socket.socket(fileno=os.dup(conn.fileno())) as own:
        name = own.getsockname()
    return client_port == (name[1] if isinstance(name, tuple) else None)
