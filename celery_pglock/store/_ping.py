"""Whether the servers a DSN names answer now: libpq's ``PQping``, which opens no
session and needs no authentication, so a process waiting for PostgreSQL (``startup``)
learns that a server is back before its next attempt is due."""

from __future__ import annotations

from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from celery_pglock._config import Settings

PING_TIMEOUT = 2  # seconds a ping may take per server (libpq's least connect_timeout)


def answering(settings: Settings) -> frozenset[str]:
    """The servers of the DSN that accept connections now, each pinged alone (``PQping``
    opens no session; with several hosts libpq would report the first one only)."""
    found = set()
    for server in servers(settings.dsn):
        conninfo = make_conninfo(
            settings.dsn, **server, target_session_attrs="any", connect_timeout=PING_TIMEOUT
        )
        if pq.PGconn.ping(conninfo.encode()) == pq.Ping.OK:
            found.add(",".join(value for value in server.values() if value))
    return frozenset(found)


def servers(dsn: str) -> list[dict[str, str]]:
    """libpq's host, hostaddr and port of each server ``dsn`` names, one dict each (an
    empty value: libpq's default, as in the DSN's own list)."""
    params = conninfo_to_dict(dsn)
    keys = [key for key in ("host", "hostaddr", "port") if params.get(key) is not None]
    lists = {key: str(params[key]).split(",") for key in keys}
    count = max((len(values) for values in lists.values()), default=1)
    return [{key: _nth(values, index) for key, values in lists.items()} for index in range(count)]


def _nth(values: list[str], index: int) -> str:
    # libpq: a list as long as the hosts', or a single value that applies to each
    return values[index] if index < len(values) else values[-1] if len(values) == 1 else ""
