"""The system under test: servers of the campaign's own and its beat and worker processes.

Everything runs on loopback ports of its own and is stopped by pid at the end: an embedded
PostgreSQL (``celery_pglock.testing.embedded``) with a synchronous streaming replica
(``celery_pglock.testing._replication``), a ``redis-server`` (broker, results, the record of
published messages), a PgBouncer in transaction pooling when installed, and a TCP proxy.
The machine's shared servers are never touched.

A failover (``fail_over``) crash-stops the primary and promotes the replica; a new replica
of the new primary later takes the old one's port (``rebuild_standby``), so the DSN that
lists both ports (``target_session_attrs=read-write``) stays right for the whole campaign.
The proxy and PgBouncer, which name one server, are pointed at the new primary, as a
failover manager's callback would.

Processes (``tests.faults.workload.Workload`` of ``tests.chaos.chaosapp``):

- beat replicas ``b1``-``b3`` (``PgLockScheduler``; leader election, or active-active);
- prefork workers (``-c 2``, ``acks_late``, ``reject_on_worker_lost``) ``w1`` straight to
  PostgreSQL, ``wp`` through the proxy, and ``wtx`` through PgBouncer's transaction
  pooling on a queue of its own (the transaction-scope entry ``tx``); ``w2``, straight to
  PostgreSQL, runs its tasks as threads (``-P threads -c 3``): their session-scope locks
  share one session of the process (``celery_pglock._shared``).

``pooled``: every process goes through PgBouncer's transaction pooling (``wp`` through the
proxy in front of PgBouncer), so every lock and the beat leader are held on rows
(``pglock_lock_backend = "auto"``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock.testing._replication import StreamingReplica
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.chaos import chaosapp
from tests.faults.pgbouncer import PgBouncer, PgBouncerUnavailable
from tests.faults.workload import Workload, session_pid
from tests.fixtures.procs import Proc, Procs
from tests.fixtures.proxy import TcpProxy
from tests.fixtures.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.chaos.chaosapp"
BEATS = ("b1", "b2", "b3")
# seconds: the app's pglock_lease (the long task has its own, 3 s). A frozen or partitioned
# holder keeps its lock this long: every slot of its lock due meanwhile is skipped `locked`.
TASK_LEASE = 2.0
BEAT_LEASE = 5.0
ROW_POLL = 0.5  # seconds: how often a standby on rows looks at the leader row, at most
CONCURRENCY = 2
POOLER_USER = "chaos_pooler"  # PgBouncer's role: its server sessions are told apart by it
RECORD_DB = 2  # Redis database of the record of published messages
RECORD_KEY = "chaos:published"

# Who connected and disconnected when, with pid and application name: the evidence.
SERVER_LOG = {
    "log_connections": "on",
    "log_disconnections": "on",
    "log_line_prefix": "%m [%p] %a ",
}
LIBRARY_SESSIONS = """
SELECT a.pid AS backend, a.application_name, a.usename, a.state,
       EXISTS (SELECT 1 FROM pg_locks l
                WHERE l.pid = a.pid AND l.locktype = 'advisory' AND l.granted) AS holds_lock
  FROM pg_stat_activity a
 WHERE a.datname = current_database()
   AND (a.application_name LIKE 'celery-pglock%%' OR a.application_name LIKE 'pglock %%')
 ORDER BY a.pid
"""
LEADER_SESSION = """
SELECT application_name FROM pg_stat_activity
 WHERE application_name LIKE 'celery-pglock beat leader %%' ORDER BY backend_start
"""
ADVISORY_LOCKS = """
SELECT (l.classid::bigint << 32) | l.objid::bigint AS key, l.pid::text AS backend,
       a.application_name, a.usename
  FROM pg_locks l LEFT JOIN pg_stat_activity a ON a.pid = l.pid
 WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
"""
# The locks held on rows, named as their holders' sessions would be (``session_pid``).
ROW_LOCKS = """
SELECT lock_key AS key, 'row ' || token AS backend,
       CASE WHEN task_id IS NULL THEN 'celery-pglock beat leader ' || pid || '@' || host
            ELSE 'pglock ' || pid || ' ' || task_id || ' ' || host END AS application_name,
       NULL AS usename
  FROM {row_locks} WHERE expires_at > now()
"""
LEADER_ROW = """
SELECT pid FROM {row_locks} WHERE lock_name = %(name)s AND expires_at > now()
"""
RUNNING_ROWS = """
SELECT r.lock_name, r.slot, r.token, r.pid, r.backend_pid,
       EXISTS (SELECT 1 FROM pg_locks l
                WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
                  AND l.pid = r.backend_pid
                  AND l.classid = ((r.lock_key >> 32) & 4294967295)::oid
                  AND l.objid = (r.lock_key & 4294967295)::oid)
       OR EXISTS (SELECT 1 FROM {row_locks} h
                   WHERE r.backend_pid IS NULL AND h.lock_key = r.lock_key
                     AND h.token = r.token AND h.expires_at > now()) AS held
  FROM {runs} r WHERE r.state = 'running'
"""
OPEN_EXECUTIONS = """
SELECT task, lock_name, slot, token, pid FROM {executions}
 WHERE ended_at IS NULL AND token IS NOT NULL ORDER BY token
"""


@dataclass
class WorkerSpec:
    queue: str
    env: dict[str, str] = field(default_factory=dict)
    pool: str = "prefork"
    concurrency: int = CONCURRENCY

    @property
    def in_process(self) -> bool:
        """Whether its tasks run in the worker's own process (no pool processes)."""
        return self.pool != "prefork"


class Cluster:
    """Servers and processes of one campaign, in ``workdir``."""

    def __init__(self, workdir: Path, *, active_active: bool, pooled: bool = False) -> None:
        self.workdir = workdir
        self.active_active = active_active
        self.pooled = pooled
        self.procs = Procs(workdir / "logs", cwd=ROOT)
        self.pg: EmbeddedPostgres = EmbeddedPostgres()  # the primary of the moment
        self.standby: StreamingReplica | None = None  # None while a new one is being built
        self.failovers = 0
        self.seats = (0, 0)  # the two servers' ports, kept across failovers
        self._lost_seat: EmbeddedPostgres | None = None  # the crashed primary, until rebuilt
        self.redis: RedisServer | None = None
        self.bouncer: PgBouncer | None = None
        self.bouncer_missing = ""
        self.proxy: TcpProxy | None = None
        self.w: Workload | None = None
        self.beats: dict[str, Proc] = {}
        self.workers: dict[str, Proc] = {}
        self.specs: dict[str, WorkerSpec] = {}
        self.started_at: dict[int, float] = {}  # pid -> when we started it (monotonic)
        self.deaths: dict[int, float] = {}  # pid -> when we killed it (epoch)
        self.frozen: set[int] = set()
        self.owners: dict[int, str] = {}  # pid -> which process it is (for the evidence)
        self.blackholes = 0  # blackholes in force on the proxy (they may overlap)

    # -- servers ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start the servers and the proxy, create the schema; no process yet."""
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.pg.start()
        # After the first start: set_config on a server never started is overwritten when
        # the first start copies the template cluster (embedded.py).
        self.pg.set_config(**SERVER_LOG)
        self.standby = self._new_standby()
        self.seats = (self.pg.port, self.standby.port)
        self.redis = RedisServer(self.workdir / "logs" / "redis.log")
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN SUPERUSER").format(sql.Identifier(POOLER_USER))
            )
        pooler_dsn = self.pg.dsn.replace("postgresql://postgres@", f"postgresql://{POOLER_USER}@")
        try:
            self.bouncer = PgBouncer(pooler_dsn, self.workdir / "logs" / "pgbouncer.log")
        except PgBouncerUnavailable as exc:
            if self.pooled:
                raise
            self.bouncer_missing = str(exc)
        app_dsn = self.bouncer.dsn_for("tx") if self.pooled and self.bouncer else self.admin_dsn
        # Pooled, the proxy stands in front of PgBouncer: a cut drops client connections.
        target = self.bouncer.port if self.pooled and self.bouncer else self.pg.port
        self.proxy = TcpProxy("127.0.0.1", target)
        record_url = f"redis://127.0.0.1:{self.redis.port}/{RECORD_DB}"
        self.w = Workload(
            name="chaos",
            admin_dsn=self.admin_dsn,
            app_dsn=app_dsn,
            redis_url=self.redis.url,
            procs=self.procs,
            app=APP,
            TEST_ACKS_LATE="1",
            TEST_LEASE=TASK_LEASE,
            TEST_BEAT_LEASE=BEAT_LEASE,
            TEST_BEAT_LEADER="0" if self.active_active else "1",
            CHAOS_RECORD_URL=record_url,
            CHAOS_RECORD_KEY=RECORD_KEY,
        )
        queue = self.w.env["TEST_QUEUE"]
        self.specs = {
            "w1": WorkerSpec(queue),
            "w2": WorkerSpec(queue, pool="threads", concurrency=3),
        }
        self.specs["wp"] = WorkerSpec(queue, {"PGLOCK_DSN": self.proxy.proxied_dsn(app_dsn)})
        if self.bouncer is not None:
            tx_queue = f"{queue}-tx"
            self.w.env["CHAOS_TX_QUEUE"] = tx_queue
            self.specs["wtx"] = WorkerSpec(tx_queue, {"PGLOCK_DSN": self.bouncer.dsn_for("tx")})
        self.w.prepare()
        with psycopg.connect(self.pg.dsn, autocommit=True) as conn:
            chaosapp.create_tables(conn)

    def close(self) -> None:
        """Stop every process, then the proxy and the servers (by pid)."""
        errors: list[BaseException] = []
        for stop in (
            self.procs.stop_all,
            *(p.stop for p in [self.proxy] if p),
            *(b.stop for b in [self.bouncer] if b),
            *(r.stop for r in [self.redis] if r),
            *(self._closer(server) for server in [self.standby, self._lost_seat] if server),
            self._closer(self.pg),
        ):
            try:
                stop()
            except Exception as exc:  # stop the others anyway
                errors.append(exc)
        if errors:
            raise errors[0]

    def _closer(self, server: EmbeddedPostgres) -> Callable[[], None]:
        """Close ``server`` after keeping its log (``postgresql-<port>-<n>.log``)."""

        def close() -> None:
            name = f"postgresql-{server.port}-{self.failovers}.log"
            with contextlib.suppress(OSError):
                shutil.copy(server.log_path, self.workdir / "logs" / name)
            server.close()

        return close

    # -- failover --------------------------------------------------------------------------

    def _new_standby(self, port: int | None = None) -> StreamingReplica:
        standby = StreamingReplica(self.pg, name="standby", synchronous="on", port=port)
        standby.start()
        return standby

    def fail_over(self) -> None:
        """Crash-stop the primary, promote the standby, point the proxy and PgBouncer at it."""
        assert self.standby is not None, "no standby to promote"
        old, self.pg, self.standby = self.pg, self.standby, None
        old.stop("immediate")
        self.pg.promote()
        self.failovers += 1
        self._lost_seat = old
        if self.proxy is not None:
            if not self.pooled:  # pooled, it stands in front of PgBouncer, retargeted below
                self.proxy.target = ("127.0.0.1", self.pg.port)
            self.proxy.cut()
        if self.bouncer is not None:
            self.bouncer.retarget(self.pg.port)

    def rebuild_standby(self) -> None:
        """A new synchronous standby of the new primary, on the lost server's port."""
        old, self._lost_seat = self._lost_seat, None
        assert old is not None, "fail_over() first"
        self._closer(old)()
        self.standby = self._new_standby(port=old.port)

    @property
    def workload(self) -> Workload:
        assert self.w is not None, "start() first"
        return self.w

    @property
    def admin_dsn(self) -> str:
        """Both servers' ports; libpq picks the writable one (the primary of the moment)."""
        first, second = self.seats
        return (
            f"postgresql://postgres@127.0.0.1:{first},127.0.0.1:{second}/postgres"
            "?target_session_attrs=read-write"
        )

    @property
    def record_url(self) -> str:
        assert self.redis is not None
        return f"redis://127.0.0.1:{self.redis.port}/{RECORD_DB}"

    # -- processes -------------------------------------------------------------------------

    def start_beat(self, label: str) -> Proc:
        current = self.beats.get(label)
        if current is not None and current.alive:
            return current
        proc = self.workload.beat(label, lead=None)
        self.beats[label] = proc
        self.started_at[proc.pid] = time.monotonic()
        return proc

    def start_worker(self, label: str) -> Proc:
        current = self.workers.get(label)
        if current is not None and current.alive:
            return current
        spec = self.specs[label]
        proc = self.workload.worker(
            label,
            concurrency=spec.concurrency,
            queue=spec.queue,
            wait=False,
            pool=spec.pool,
            **spec.env,
        )
        self.workers[label] = proc
        self.started_at[proc.pid] = time.monotonic()
        return proc

    def ready(self, proc: Proc) -> bool:
        """A worker consumes; a beat replica leads, stands by, or (active-active) ticks."""
        if proc in self.workers.values():
            return self.workload.worker_ready(proc)
        text = proc.log_text()
        if self.active_active:
            return "Sending due task" in text
        if self.pooled:  # a standby on rows polls the leader row, not the lock queue
            return "beat leader election on rows" in text
        return "is now the leader" in text or self.workload.standing_by(proc)

    def live_beats(self) -> list[tuple[str, Proc]]:
        return [(label, proc) for label, proc in sorted(self.beats.items()) if proc.alive]

    def live_workers(self) -> list[tuple[str, Proc]]:
        return [(label, proc) for label, proc in sorted(self.workers.items()) if proc.alive]

    def track(self) -> None:
        """Remember every pid of our processes and what it is (pool processes come and go)."""
        self.workload.track()
        for proc in [*self.beats.values(), *self.workers.values()]:
            self.owners.setdefault(proc.pid, proc.name)
            for child in proc.children() if proc.alive else []:
                self.owners.setdefault(child, f"{proc.name} pool process")

    def kill(self, proc: Proc) -> None:
        """SIGKILL a process and its descendants, as a dying container."""
        family = [proc.pid, *proc.descendants()]
        self.track()
        self.workload.killed.add(proc.pid)
        now = time.time()  # taken before: a standby may lead before kill() returns
        proc.kill(tree=True)
        for pid in family:
            self.deaths[pid] = now
            self.frozen.discard(pid)

    def kill_pid(self, pid: int) -> None:
        """SIGKILL one process (a pool process: its worker starts another)."""
        self.workload.pids.add(pid)
        self.deaths[pid] = time.time()
        self.signal_pid(pid, signal.SIGKILL)

    @staticmethod
    def signal_pid(pid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def pool_processes(self) -> set[int]:
        """The processes running tasks: prefork workers' children, and the workers whose
        tasks run as threads in the worker itself."""
        return self.pool_children() | self.in_process_workers()

    def pool_children(self) -> set[int]:
        return {
            pid
            for label, proc in self.live_workers()
            if not self.specs[label].in_process
            for pid in proc.children()
        }

    def in_process_workers(self) -> set[int]:
        return {proc.pid for label, proc in self.live_workers() if self.specs[label].in_process}

    def lease_of(self, task: str) -> float:
        return chaosapp.LONG_LEASE if task == "chaos.long" else TASK_LEASE

    # -- what the server says ----------------------------------------------------------------

    def query(self, text: str | sql.Composable, params: Any = None) -> list[dict[str, Any]]:
        with (
            psycopg.connect(self.admin_dsn, autocommit=True, connect_timeout=3) as conn,
            conn.cursor(row_factory=dict_row) as cur,
        ):
            return cur.execute(text, params).fetchall()  # type: ignore[arg-type]

    def table(self, name: str) -> sql.Identifier:
        return sql.Identifier(self.workload.schema, name)

    def leader_pid(self) -> int | None:
        """The pid of the beat replica whose session holds leadership (None: none, or down)."""
        if self.active_active:
            return None
        try:
            if self.pooled:
                return self._leader_on_rows()
            rows = self.query(LEADER_SESSION)
        except psycopg.OperationalError:
            return None
        return session_pid(rows[0]["application_name"]) if rows else None

    def _leader_on_rows(self) -> int | None:
        query = sql.SQL(LEADER_ROW).format(row_locks=self.table("pglock_row_locks"))
        rows = self.query(query, {"name": f"{self.workload.namespace}:beat-leader"})
        return int(rows[0]["pid"]) if rows else None

    def recovery_lease(self, task: str) -> float:
        """How long a lost holder keeps what the task needs: its lock's lease, and on rows
        also the beat leader's (a killed leader's row lives until its lease ran out)."""
        if not self.pooled:
            return self.lease_of(task)
        return max(self.lease_of(task), BEAT_LEASE + ROW_POLL)

    def running_tasks(self) -> list[dict[str, Any]]:
        """Executions running now in a live, unfrozen pool process, oldest token first."""
        try:
            rows = self.query(sql.SQL(OPEN_EXECUTIONS).format(executions=self.table("executions")))
        except psycopg.Error:
            return []
        pool = self.pool_processes() - self.frozen - set(self.deaths)
        return [row for row in rows if row["pid"] in pool]

    def wait_for_running(self, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            found = self.running_tasks()
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def library_sessions(self) -> list[dict[str, Any]]:
        try:
            return self.query(LIBRARY_SESSIONS)
        except psycopg.OperationalError:
            return []

    def advisory_locks(self) -> list[dict[str, Any]]:
        """The locks held: advisory ones, and those on rows (the rows lock backend)."""
        on_rows = sql.SQL(ROW_LOCKS).format(row_locks=self.table("pglock_row_locks"))
        return self.query(ADVISORY_LOCKS) + self.query(on_rows)

    def running_rows(self) -> list[dict[str, Any]]:
        query = sql.SQL(RUNNING_ROWS).format(
            runs=self.table("pglock_runs"), row_locks=self.table("pglock_row_locks")
        )
        return self.query(query)

    def open_executions(self) -> list[dict[str, Any]]:
        return self.query(sql.SQL(OPEN_EXECUTIONS).format(executions=self.table("executions")))

    def fenced_writes(self) -> list[dict[str, Any]]:
        return self.query(
            sql.SQL("SELECT * FROM {} ORDER BY id").format(self.table("fenced_writes"))
        )


def alive(pid: int) -> bool:
    """A process exists and is not a zombie (a frozen one is alive)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
