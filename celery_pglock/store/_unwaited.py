"""A statement sent without waiting for its reply; the reply is read when the connection
is next taken.

For a statement whose result nobody needs at once: the release of a lock that has no
ledger row to record. The server frees the lock as soon as it reads the statement, so the
task returns one round trip sooner. libpq's asynchronous calls under psycopg's
``Connection``: until ``read_reply``, nothing else may use the connection.
"""

from __future__ import annotations

import select
from collections.abc import Sequence

import psycopg
from psycopg import pq

from celery_pglock.store._driver import Connection

TUPLES_OK = pq.ExecStatus.TUPLES_OK


def quiet(conn: Connection) -> bool:
    """Nothing arrived unasked since the last reply (such as the error a server sends
    before it ends a session): a statement sent now will most likely be read."""
    return not _ready(conn.pgconn.socket, write=False, timeout=0)


def send(conn: Connection, query: bytes, params: Sequence[str | None], timeout: float) -> None:
    """Send ``query`` ($1, $2… placeholders, text parameters or NULL) and return at once."""
    encoding = conn.info.encoding
    values = [None if param is None else param.encode(encoding) for param in params]
    with conn.lock:
        pgconn = conn.pgconn
        pgconn.send_query_params(query, values)
        while pgconn.flush():  # 1 while part of it waits for room in the socket
            _wait(pgconn, timeout, write=True)


def read_reply(conn: Connection, timeout: float) -> None:
    """Read the reply of ``send``; raise ``psycopg.OperationalError`` if it failed."""
    failure = None
    with conn.lock:
        pgconn = conn.pgconn
        while True:
            pgconn.consume_input()
            while pgconn.is_busy():
                _wait(pgconn, timeout, write=False)
                pgconn.consume_input()
            result = pgconn.get_result()
            if result is None:
                break
            if result.status != TUPLES_OK:
                message = (result.error_message or b"").decode(conn.info.encoding, "replace")
                failure = message.strip() or f"status {result.status}"
    if failure is not None:
        raise psycopg.OperationalError(failure)


def _wait(pgconn: pq.abc.PGconn, timeout: float, *, write: bool) -> None:
    if not _ready(pgconn.socket, write=write, timeout=timeout):
        raise psycopg.OperationalError(f"no reply from the server within {timeout:.1f} s")


def _ready(fd: int, *, write: bool, timeout: float) -> bool:
    if hasattr(select, "poll"):  # select() cannot watch a descriptor above 1023
        poller = select.poll()
        poller.register(fd, select.POLLOUT if write else select.POLLIN)
        return bool(poller.poll(timeout * 1000))
    watched = ([], [fd]) if write else ([fd], [])
    readable, writable, _ = select.select(*watched, [], timeout)
    return bool(readable or writable)
