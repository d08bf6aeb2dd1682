"""Count PostgreSQL round trips exactly: a loopback TCP proxy that reads the client's messages.

A round trip ends with a ``Sync`` (extended protocol) or is a simple ``Query``: the client
then waits for ``ReadyForQuery``. The proxy counts them and remembers what each carried
(the statements parsed or bound since the previous one), so a per-task figure can be
explained ("acquire, release"). Used only in a separate, untimed pass.
"""

from __future__ import annotations

import collections
import contextlib
import socket
import struct
import threading
from collections.abc import Iterator

from psycopg.conninfo import make_conninfo

CHUNK = 64 * 1024


def label(sql_text: str) -> str:
    """A short name for a statement: its first line that is not a comment."""
    for line in sql_text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("--"):
            return " ".join(stripped.split())[:48]
    return sql_text[:48]


class CountingProxy:
    """Forward ``127.0.0.1:<port>`` to PostgreSQL, counting round trips by what they carried."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.trips: collections.Counter[str] = collections.Counter()
        self.closed = False
        threading.Thread(target=self._accept, name="rt-proxy", daemon=True).start()

    def dsn(self, dsn: str) -> str:
        return make_conninfo(
            dsn, host="127.0.0.1", port=str(self.port), sslmode="disable", gssencmode="disable"
        )

    def reset(self) -> None:
        with self.lock:
            self.trips.clear()

    def snapshot(self) -> collections.Counter[str]:
        with self.lock:
            return collections.Counter(self.trips)

    def close(self) -> None:
        self.closed = True
        self.listener.close()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._upstream, args=(client, server), daemon=True).start()
            threading.Thread(target=_pump, args=(server, client), daemon=True).start()

    def _count(self, carried: list[str]) -> None:
        with self.lock:
            self.trips[", ".join(carried) or "sync"] += 1

    def _upstream(self, client: socket.socket, server: socket.socket) -> None:
        """Client to server: forward everything, parse message boundaries on the way."""
        buffer = b""
        started = False
        prepared: dict[bytes, str] = {}
        carried: list[str] = []
        with contextlib.suppress(OSError):
            while chunk := client.recv(CHUNK):
                server.sendall(chunk)
                buffer += chunk
                if not started and len(buffer) >= 4:  # startup packet: length, no type byte
                    size = struct.unpack("!I", buffer[:4])[0]
                    if len(buffer) < size:
                        continue
                    buffer, started = buffer[size:], True
                for kind, body in _messages(buffer):
                    self._message(kind, body, prepared, carried)
                buffer = _rest(buffer)
        _close(client, server)

    def _message(
        self, kind: bytes, body: bytes, prepared: dict[bytes, str], carried: list[str]
    ) -> None:
        if kind == b"Q":
            self._count([label(body.rstrip(b"\0").decode(errors="replace"))])
        elif kind == b"P":
            name, rest = body.split(b"\0", 1)
            text = label(rest.split(b"\0", 1)[0].decode(errors="replace"))
            prepared[name] = text
            carried.append(text)
        elif kind == b"B":
            _portal, rest = body.split(b"\0", 1)
            statement = rest.split(b"\0", 1)[0]
            if statement and statement in prepared:  # a prepared statement, not just parsed
                carried.append(prepared[statement])
        elif kind == b"S":
            self._count(list(dict.fromkeys(carried)))
            carried.clear()


def _messages(buffer: bytes) -> Iterator[tuple[bytes, bytes]]:
    """Complete typed messages at the start of ``buffer``."""
    offset = 0
    while len(buffer) - offset >= 5:
        size = struct.unpack("!I", buffer[offset + 1 : offset + 5])[0]
        if len(buffer) - offset < 1 + size:
            return
        yield buffer[offset : offset + 1], buffer[offset + 5 : offset + 1 + size]
        offset += 1 + size


def _rest(buffer: bytes) -> bytes:
    """What is left of ``buffer`` after its complete messages."""
    offset = 0
    while len(buffer) - offset >= 5:
        size = struct.unpack("!I", buffer[offset + 1 : offset + 5])[0]
        if len(buffer) - offset < 1 + size:
            break
        offset += 1 + size
    return buffer[offset:]


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(CHUNK):
            sink.sendall(chunk)
    _close(source, sink)


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        with contextlib.suppress(OSError):
            sock.close()
