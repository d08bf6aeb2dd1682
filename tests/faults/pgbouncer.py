"""A PgBouncer (the Debian package's binary) on a loopback port, started by a test.

One process serves two databases in front of the same PostgreSQL database: ``tx``
(``pool_mode = transaction``) and ``session`` (``pool_mode = session``). It runs in the
foreground as a child of the test, as an unprivileged user when the test runs as root
(PgBouncer refuses root), and is stopped by pid.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from celery_pglock.testing.embedded import DEFAULT_USER
from tests.fixtures.procs import wait_until
from tests.fixtures.services import unavailable

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0

INI = """\
[databases]
tx = {target} pool_mode=transaction
session = {target} pool_mode=session

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {auth_file}
max_client_conn = {max_client_conn}
default_pool_size = 20
ignore_startup_parameters = extra_float_digits,options
server_reset_query = DISCARD ALL
# After a failed server login (PostgreSQL restarting) refuse clients for 1 s, not 15.
server_login_retry = 1
logfile =
pidfile =
"""


class PgBouncerUnavailable(RuntimeError):
    """The pgbouncer binary is missing or did not start."""


class PgBouncer:
    """``pgbouncer`` in front of the server of ``dsn``; ``dsn_for("tx"|"session")``."""

    def __init__(self, dsn: str, log_path: Path, *, max_client_conn: int = 500) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise PgBouncerUnavailable(
                "pgbouncer is not installed (Debian: apt-get install -y pgbouncer)"
            )
        self.upstream = conninfo_to_dict(dsn)
        self.max_client_conn = max_client_conn
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pglock-pgbouncer-"))
        user = str(self.upstream.get("user") or "postgres")
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        ini = self.dir / "pgbouncer.ini"
        self._write_ini()
        self.argv = [binary, str(ini)]
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            account = _unprivileged_account()
            os.chown(self.dir, account.pw_uid, account.pw_gid)
            self.argv[1:1] = ["-u", account.pw_name]
        self.log_path = log_path
        self._launch()

    def _launch(self) -> None:
        with self.log_path.open("ab") as log:
            self.popen = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(self._answers, timeout=START_TIMEOUT, message="pgbouncer to answer")
        except AssertionError as exc:
            self.stop()
            raise PgBouncerUnavailable(f"{exc}: {self.log_path.read_text()[-2000:]}") from None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def restart(self) -> None:
        """Stop (immediate shutdown: every client and server connection is closed) and start
        again on the same port with the same configuration; return once it answers."""
        self._terminate()
        self._launch()

    def retarget(self, port: int) -> None:
        """Point PgBouncer at the server on ``port`` (a new primary) and restart it, as a
        failover manager's callback would."""
        self.upstream["port"] = str(port)
        self._write_ini()
        self.restart()

    def _write_ini(self) -> None:
        user = str(self.upstream.get("user") or "postgres")
        target = make_conninfo(
            host=str(self.upstream.get("hostaddr") or self.upstream.get("host") or "127.0.0.1"),
            port=str(self.upstream.get("port") or 5432),
            dbname=str(self.upstream.get("dbname") or user),
            user=user,
        )
        text = INI.format(
            target=target,
            port=self.port,
            auth_file=self.dir / "users.txt",
            max_client_conn=self.max_client_conn,
        )
        (self.dir / "pgbouncer.ini").write_text(text)

    def dsn_for(self, database: str) -> str:
        """The DSN of ``database`` ("tx" or "session") through this PgBouncer."""
        user = str(self.upstream.get("user") or "postgres")
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def _answers(self) -> bool:
        if self.popen.poll() is not None:
            raise AssertionError(f"pgbouncer exited with {self.popen.returncode}")
        try:
            with psycopg.connect(self.dsn_for("session"), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
        except psycopg.OperationalError:
            return False
        return True

    def stop(self) -> None:
        """SIGTERM (immediate shutdown), SIGKILL if it lingers; remove its files."""
        self._terminate()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


@contextmanager
def started(dsn: str, log_path: Path, *, max_client_conn: int = 500) -> Iterator[PgBouncer]:
    """A ``PgBouncer`` for the ``with`` block, stopped after it; the test fails (or skips,
    when pgbouncer is not required) if it cannot start."""
    try:
        bouncer = PgBouncer(dsn, log_path, max_client_conn=max_client_conn)
    except PgBouncerUnavailable as exc:
        unavailable("pgbouncer", str(exc))
    try:
        yield bouncer
    finally:
        bouncer.stop()


def _unprivileged_account() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(DEFAULT_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--user-group", "--no-create-home", DEFAULT_USER],
            check=False,
            capture_output=True,
        )
        return pwd.getpwnam(DEFAULT_USER)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
