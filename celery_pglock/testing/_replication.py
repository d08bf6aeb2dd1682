"""A real streaming replica of an embedded server, for failover tests and benchmarks.

A failover is only proven on a real one: a hot standby made by ``pg_basebackup -R`` from
the same binaries, on a loopback port of its own, streaming WAL from the primary, and
promoted by ``pg_ctl promote``. Asynchronous by default; ``synchronous="on"`` or
``"remote_apply"`` makes the primary wait for it at every commit.

To leave a replica deliberately behind (what asynchronous replication loses at a crash),
``stop_shipping()`` clears its ``primary_conninfo``: pausing replay would not do, since
promotion replays everything already received.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg
from psycopg import sql

from celery_pglock.testing.embedded import (
    DEFAULT_USER,
    EmbeddedPostgres,
    EmbeddedPostgresError,
    _run,
)

__all__ = ["SYNCHRONOUS_COMMIT_LEVELS", "StreamingReplica", "timeline"]

SYNCHRONOUS_COMMIT_LEVELS = ("on", "remote_apply")
"""``synchronous_commit`` levels a synchronous replica can be run with."""

_WAIT = 30.0  # seconds; streaming starts, and replay catches up, in well under one
_POLL = 0.02


class StreamingReplica(EmbeddedPostgres):
    """A hot standby of ``primary``, named ``name`` in ``pg_stat_replication``, on ``port``
    (default: a free one; a given one lets a new standby take a lost server's place).

    :meth:`start` copies the primary with ``pg_basebackup`` (first start only) and returns
    once the replica streams. With ``synchronous`` the primary then lists it in
    ``synchronous_standby_names``: from that moment a commit on the primary returns only
    once this replica has it (``"on"``: flushed; ``"remote_apply"``: visible to queries).
    """

    def __init__(
        self,
        primary: EmbeddedPostgres,
        *,
        name: str = "replica",
        synchronous: str | None = None,
        port: int | None = None,
        user: str = DEFAULT_USER,
    ) -> None:
        if synchronous is not None and synchronous not in SYNCHRONOUS_COMMIT_LEVELS:
            levels = ", ".join(SYNCHRONOUS_COMMIT_LEVELS)
            raise ValueError(f"synchronous must be one of {levels} or None, not {synchronous!r}")
        super().__init__(bin_dir=primary.bin_dir, port=port, user=user)
        self.primary = primary
        self.name = name
        self.synchronous = synchronous
        self.promoted = False

    def start(self) -> None:
        """Start; as a standby, return once it streams (and, if synchronous, is the
        primary's synchronous standby). Once promoted, it starts as the primary it is."""
        super().start()
        if self.promoted:
            return
        self._wait(self._streaming, "start streaming from the primary")
        if self.synchronous is not None:
            self.primary.set_config(
                synchronous_standby_names=str(sql.Identifier(self.name).as_string()),
                synchronous_commit=self.synchronous,
            )
            self._wait(self._synchronous, "become the primary's synchronous standby")

    def _initdb(self) -> None:
        """Instead of a new cluster: a copy of the primary's, set up to follow it."""
        backup = [str(self.bin_dir / "pg_basebackup"), "-D", str(self.datadir)]
        backup += ["-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres"]
        _run([*backup, "-X", "stream", "-R", "--checkpoint=fast", "--no-sync"], self._account)
        # The copy holds the primary's socket lock files (the socket lives in the datadir):
        # stale here, but on the primary's port (a new standby taking a lost primary's
        # seat) one naming a pid that still exists, a zombie init has not reaped yet,
        # makes the server refuse to start.
        for stale in self.datadir.glob(".s.PGSQL.*"):
            stale.unlink(missing_ok=True)
        self._write_auto_conf({"primary_conninfo": self._primary_conninfo()})

    def _primary_conninfo(self) -> str:
        port, name = self.primary.port, self.name
        return f"host=127.0.0.1 port={port} user=postgres application_name={name}"

    # -- what failover tests do to it ------------------------------------------------------

    def wait_replayed(self) -> None:
        """Return once this replica has replayed all the WAL the primary has written."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            target = _scalar(conn, "SELECT pg_current_wal_lsn()")
        self._wait(lambda conn: _scalar(conn, _REPLAYED_SQL, target), "replay the primary's WAL")

    def stop_shipping(self) -> None:
        """Stop receiving WAL, as a replica cut off from its primary: what the primary
        writes from now on is never here, and a promotion now loses it."""
        self.set_config(primary_conninfo="")
        self._wait(lambda conn: not _scalar(conn, _RECEIVING_SQL), "stop its WAL receiver")

    def promote(self) -> None:
        """Make this replica a primary (``pg_ctl promote``); return once it takes writes."""
        self._pg_ctl("promote", "-w", "-t", "30")
        self._wait(lambda conn: not _scalar(conn, "SELECT pg_is_in_recovery()"), "be promoted")
        self.promoted = True

    # -- polling ---------------------------------------------------------------------------

    def _streaming(self, _: psycopg.Connection[Any]) -> bool:
        return self._primary_says(_STREAMING_SQL)

    def _synchronous(self, _: psycopg.Connection[Any]) -> bool:
        return self._primary_says(_SYNC_SQL)

    def _primary_says(self, query: str) -> bool:
        """What ``pg_stat_replication`` on the primary says of this replica."""
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            return bool(_scalar(conn, query, self.name))

    def _wait(self, done: Any, what: str) -> None:
        deadline = time.monotonic() + _WAIT
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while time.monotonic() < deadline:
                if done(conn):
                    return
                time.sleep(_POLL)
        raise EmbeddedPostgresError(f"replica {self.name!r} did not {what}; see {self.log_path}")


def timeline(server: EmbeddedPostgres) -> int:
    """The timeline ``server`` writes on: 1 for a new cluster, one more per promotion."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        return int(_scalar(conn, _TIMELINE_SQL))


# The timeline of the WAL being written now. Not pg_control_checkpoint(): its timeline
# changes only at the first checkpoint after a promotion, seconds later.
_TIMELINE_SQL = "SELECT ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int"
_STREAMING_SQL = (
    "SELECT EXISTS (SELECT 1 FROM pg_stat_replication"
    " WHERE application_name = %s AND state = 'streaming')"
)
_SYNC_SQL = (
    "SELECT EXISTS (SELECT 1 FROM pg_stat_replication"
    " WHERE application_name = %s AND sync_state = 'sync')"
)
_REPLAYED_SQL = "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn"
_RECEIVING_SQL = "SELECT EXISTS (SELECT 1 FROM pg_stat_wal_receiver)"


def _scalar(conn: psycopg.Connection[Any], query: str, *params: object) -> Any:
    row = conn.execute(query.encode(), params or None).fetchone()
    return row[0] if row else None
