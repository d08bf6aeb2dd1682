"""The pool's rules, on stand-in connections (no server): the cap, waiters in order, a
full server waited out, idle connections closed; and the settings that drive them."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_pglock._config import Settings
from celery_pglock.errors import ConfigurationError, DatabaseUnavailable, ServerFull
from celery_pglock.store._failures import translate
from celery_pglock.store._pool import Pool
from celery_pglock.testing._processes import wait_until

DSN = "postgresql://u@127.0.0.1/db"


class FakeConn:
    """What the pool touches of a connection: ``closed`` and ``close()``."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.closed = False

    def close(self) -> None:
        self.closed = True


class Server:
    """Hands out ``FakeConn``s, refusing (``ServerFull``) beyond ``slots`` open ones."""

    def __init__(self, slots: int = 1000) -> None:
        self.slots = slots
        self.opened: list[FakeConn] = []
        self.refusals = 0

    def connect(self) -> Any:
        if sum(not c.closed for c in self.opened) >= self.slots:
            self.refusals += 1
            raise ServerFull("too many clients already")
        conn = FakeConn(len(self.opened))
        self.opened.append(conn)
        return conn


def pool_of(server: Server, **kwargs: Any) -> Pool:
    options: dict[str, Any] = {"max_size": 4, "idle_timeout": None, "timeout": 5.0}
    options.update(kwargs)
    return Pool(server.connect, name="test", **options)


def test_settings_defaults_and_validation() -> None:
    settings = Settings.from_conf({"pglock_dsn": DSN})
    assert (30.0, 5) == (settings.idle_timeout, settings.spare_connections)
    kept = Settings.from_conf({"pglock_dsn": DSN, "pglock_idle_timeout": 0})
    assert kept.idle_timeout is None
    for name, bad in (("pglock_idle_timeout", -1), ("pglock_spare_connections", -1)):
        with pytest.raises(ConfigurationError, match=name):
            Settings.from_conf({"pglock_dsn": DSN, name: bad})


@pytest.mark.parametrize(
    "message",
    [
        "FATAL:  sorry, too many clients already",
        'FATAL:  too many connections for role "app"',
        "FATAL:  remaining connection slots are reserved for non-replication superuser connections",
        "FATAL:  remaining connection slots are reserved for roles with the SUPERUSER attribute",
        "FATAL:  no more connections allowed (max_client_conn)",  # PgBouncer's, no SQLSTATE
    ],
)
def test_a_full_server_is_told_apart(message: str) -> None:
    import psycopg  # noqa: PLC0415

    assert isinstance(translate(psycopg.OperationalError(message)), ServerFull)


def test_last_given_back_is_handed_out_first() -> None:
    pool = pool_of(Server())
    first, second = pool.getconn(), pool.getconn()
    pool.putconn(first)
    pool.putconn(second)
    assert second is pool.getconn()


def test_waiters_get_connections_in_order_and_never_time_out_while_some_come_back() -> None:
    """Pool of 1, timeout 0.5 s, 6 callers holding 0.2 s each (1.2 s in all): none fails."""
    pool = pool_of(Server(), max_size=1, timeout=0.5)
    served: list[int] = []
    errors: list[BaseException] = []
    held = pool.getconn()

    def run(number: int) -> None:
        try:
            conn = pool.getconn()
            served.append(number)
            time.sleep(0.2)
            pool.putconn(conn)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(6)]
    for number, thread in enumerate(threads):
        thread.start()
        wait_until(lambda n=number: pool.waiters == n + 1, timeout=5, message="queued")
    pool.putconn(held)
    for thread in threads:
        thread.join(10)
    assert ([], list(range(6))) == (errors, served)


def test_no_connection_given_back_within_the_timeout_fails() -> None:
    pool = pool_of(Server(), max_size=1, timeout=0.3)
    pool.getconn()
    with pytest.raises(DatabaseUnavailable, match="pglock_pool_size"):
        pool.getconn()


def test_a_full_server_is_waited_out_on_the_process_own_connections() -> None:
    """The server takes 2: a third caller waits for one of them, and gets it."""
    server = Server(slots=2)
    pool = pool_of(server, max_size=10, timeout=2.0)
    first, _second = pool.getconn(), pool.getconn()
    got: list[Any] = []
    thread = threading.Thread(target=lambda: got.append(pool.getconn()))
    thread.start()
    wait_until(lambda: pool.waiters == 1, timeout=5, message="the third caller waits")
    pool.putconn(first)
    thread.join(5)
    assert [first] == got
    assert 1 == server.refusals
    assert 2 == pool.size


def test_a_full_server_holding_none_of_ours_is_an_outage_after_the_timeout() -> None:
    pool = pool_of(Server(slots=0), timeout=0.3)
    with pytest.raises(ServerFull):
        pool.getconn()
    assert 0 == pool.size


def test_idle_connections_are_closed_after_the_idle_timeout() -> None:
    pool = pool_of(Server(), idle_timeout=0.2)
    conns = [pool.getconn() for _ in range(3)]
    held = conns.pop()
    for conn in conns:
        pool.putconn(conn)
    wait_until(lambda: all(c.closed for c in conns), timeout=5, message="idle closed")
    assert not held.closed
    assert 1 == pool.size
    pool.putconn(held)
    wait_until(lambda: held.closed, timeout=5, message="the last one closed")
    assert 0 == pool.size


def test_a_closed_connection_given_back_frees_its_place() -> None:
    pool = pool_of(Server(), max_size=1, timeout=0.3)
    conn = pool.getconn()
    conn.close()
    pool.putconn(conn)
    assert 0 == pool.size
    assert pool.getconn() is not conn
