"""A hardened deployment: least-privilege role with a password, hostile schema, connection cap.

One run on a server of its own where PUBLIC may not even connect. The app's role has a
password (checked: scram-sha-256), CONNECT on the database and USAGE + CREATE on its own
schema, named ``we"ird; DROP TABLE x;--``; nothing else. The CLI migrates as that role;
a worker and a beat replica run jobs; the role's connection limit is then hit (its idle
pooled sessions ended, ``CONNECTION LIMIT 1``) while a burst of jobs arrives, and lifted.
A worker with a wrong password is started too. Every log line, CLI output, task result
and ``repr`` is then searched for the passwords.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from celery_pglock._config import Settings
from celery_pglock._dsn import check_dsn
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.errors import PgLockError
from celery_pglock.store._connections import connect
from celery_pglock.store._database import Database
from celery_pglock.testing.embedded import EmbeddedPostgres
from tests.faults.workload import MEASUREMENTS, Invariants, Run, Sent, Workload
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.faults

SLOT = "2026-11-29T18:05:00Z"
SCHEMA = 'we"ird; DROP TABLE x;--'
ROLE = "pglock_app"
BURST = 4
DEADLINE = 60.0
APP = "tests.faults.faultapp"


def harden(server: EmbeddedPostgres, password: str) -> str:
    """Create the role, its schema and grants, require its password; return its DSN."""
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("REVOKE CONNECT, TEMPORARY ON DATABASE postgres FROM PUBLIC")
        conn.execute("REVOKE ALL ON SCHEMA public FROM PUBLIC")
        conn.execute("CREATE TABLE public.x (id int)")
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {} NOSUPERUSER NOCREATEDB NOCREATEROLE").format(
                sql.Identifier(ROLE), sql.Literal(password)
            )
        )
        conn.execute(
            sql.SQL("GRANT CONNECT ON DATABASE postgres TO {}").format(sql.Identifier(ROLE))
        )
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(SCHEMA)))
        conn.execute(
            sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(
                sql.Identifier(SCHEMA), sql.Identifier(ROLE)
            )
        )
    hba = server.datadir / "pg_hba.conf"
    hba.write_text(f"host all {ROLE} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    with psycopg.connect(server.dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")
    without = f"postgresql://{ROLE}@127.0.0.1:{server.port}/postgres"
    wait_until(lambda: _refused(without), timeout=10, message="the role to need its password")
    # '?' and '#' are legal unencoded in the userinfo of a libpq URL, and easy to miss.
    return f"postgresql://{ROLE}:{password}@127.0.0.1:{server.port}/postgres"


def _refused(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=2).close()
    except psycopg.OperationalError as exc:
        return "password" in str(exc)
    return False


def cli(w: Workload, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``celery -A faultapp pglock ARGS`` as the app's role; (exit status, all output)."""
    proc = w.procs.celery(APP, "pglock", *args, env={**w.env, **(env or {})}, name="cli")
    return proc.wait(DEADLINE), proc.log_text()


def connection_cap(w: Workload, facts: dict[str, Any]) -> None:
    """The role may open no more connection: its idle pooled ones end, a burst arrives."""
    with psycopg.connect(w.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT 1").format(sql.Identifier(ROLE)))
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE usename = %s AND application_name NOT LIKE '%%beat%%'",
            (ROLE,),
        )
    burst: list[Sent] = []
    for _ in range(BURST):
        burst += w.send(w.key("capped"), slot=SLOT, copies=2, via="lock")
    w.wait_for(
        lambda: all(s.result.state == "RETRY" for s in burst),
        timeout=DEADLINE,
        message="the capped jobs to be retried",
    )
    ran_while_capped = [r for r in w.executions() if "capped" in (r["lock_name"] or "")]
    facts["retry-metas"] = w.metas(s.result.id for s in burst)  # they hold the DB error
    with psycopg.connect(w.admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER ROLE {} CONNECTION LIMIT -1").format(sql.Identifier(ROLE)))
    lifted = time.monotonic()
    w.settle(burst, timeout=DEADLINE)
    MEASUREMENTS[f"{w.name}: connection cap lifted -> burst of {BURST} slots done"] = round(
        time.monotonic() - lifted, 3
    )
    facts["capped"] = (burst, ran_while_capped)


def reprs(dsn: str, wrong_dsn: str, password: str) -> list[str]:
    """``repr`` and ``str`` of what the library hands out, for a password-bearing DSN."""
    settings = Settings(dsn=dsn, schema=SCHEMA)
    db = Database(settings)
    db.open()
    try:
        claim = Claim("repr:job", lock_key("repr:job"), None, "task-id", "repr.job")
        lease = acquire(db, claim, "session", 5.0)
        assert isinstance(lease, Lease)
        found = [repr(settings), str(settings), repr(db), repr(db.pool), repr(lease), repr(claim)]
        release(db, lease, "succeeded")
    finally:
        db.close()
    unreachable = dsn.replace(f":{conninfo_to_dict(dsn)['port']}/", ":1/")
    for bad in (unreachable, wrong_dsn):
        try:
            connect(Settings(dsn=bad)).close()
        except PgLockError as exc:
            found += [repr(exc), str(exc)]
    try:
        check_dsn(f"host=127.0.0.1 user={ROLE} password={password} port")
    except PgLockError as exc:
        found += [repr(exc), str(exc)]
    return found


@pytest.fixture(scope="module")
def run(redis_url: str, run_pg: EmbeddedPostgres, run_procs: Procs) -> Run:
    """Harden the server, migrate, run, cap connections, capture everything, check."""
    password = f"pw?{uuid.uuid4().hex}#{uuid.uuid4().hex[:6]}"
    wrong = f"wrong{uuid.uuid4().hex}"
    dsn = harden(run_pg, password)
    w = Workload(
        name="secure",
        admin_dsn=run_pg.dsn,
        app_dsn=dsn,
        redis_url=redis_url,
        procs=run_procs,
        schema=SCHEMA,
    )
    result = Run(w)
    result.facts["secrets"] = (password, quote(password), wrong)
    w.prepare()
    result.facts["migrate"] = cli(w, "migrate")
    w.worker("main", concurrency=3)
    w.beat()
    w.settle(
        w.send(w.key("warm"), slot=SLOT, copies=2)
        + w.send(w.key("warm-tx"), slot=SLOT, task="faults.job_tx")
    )
    connection_cap(w, result.facts)
    result.facts["status"] = cli(w, "status")
    result.facts["runs"] = cli(w, "runs", "--json")
    wrong_dsn = dsn.replace(password, wrong)
    result.facts["cli-wrong"] = cli(w, "status", env={"PGLOCK_DSN": wrong_dsn})
    refused = run_procs.celery(
        APP,
        "worker",
        *("-Q", w.env["TEST_QUEUE"] + "-x", "-l", "info", "--without-mingle", "--without-gossip"),
        env={**w.env, "PGLOCK_DSN": wrong_dsn},
        name="worker-wrong-password",
    )
    result.facts["worker-wrong"] = (refused.wait(DEADLINE), refused.log_text())
    result.facts["reprs"] = reprs(dsn, wrong_dsn, password)
    w.stop()
    result.report = w.check()
    return result


class TestInvariants(Invariants):
    """The run keeps every promise (``workload.Invariants``)."""

    min_slots = BURST + 1


def test_least_privilege_role_migrates_and_owns_the_tables(run: Run) -> None:
    """The role without superuser, CREATEDB or database CREATE ran the migration itself."""
    status, output = run.facts["migrate"]
    query = "SELECT DISTINCT tableowner FROM pg_tables WHERE schemaname = %s"
    with psycopg.connect(run.workload.admin_dsn) as conn:
        owners = [row[0] for row in conn.execute(query, (SCHEMA,)).fetchall()]
        superuser = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (ROLE,))
        assert (False,) == superuser.fetchone()
    assert (0, True) == (status, "applied migration 1" in output)
    assert [ROLE] == owners


def test_operator_commands_work_under_the_least_privilege_role(run: Run) -> None:
    """`celery pglock status` and `runs` read locks, sessions and the ledger as that role."""
    (status, text), (runs_status, runs) = run.facts["status"], run.facts["runs"]
    assert (0, 0) == (status, runs_status), text + runs
    assert "capped" in runs


def test_hostile_schema_name_is_only_ever_a_name(run: Run) -> None:
    """A schema named with a quote and SQL holds the tables; the table it names survives."""
    with psycopg.connect(run.workload.admin_dsn) as conn:
        assert (0,) == conn.execute("SELECT count(*) FROM public.x").fetchone()
    assert [] != [r for r in run.workload.ledger() if r["state"] == "succeeded"]


def test_connection_cap_makes_jobs_wait_never_run_unlocked(run: Run) -> None:
    """At the role's connection cap jobs are retried, none runs; lifted, each slot runs once."""
    burst, ran_while_capped = run.facts["capped"]
    ran = [r for r in run.workload.executions() if "capped" in (r["lock_name"] or "")]
    assert [] == ran_while_capped
    assert ["SKIPPED"] * BURST + ["SUCCESS"] * BURST == sorted(s.result.state for s in burst)
    assert BURST == len({r["lock_name"] for r in ran}) == len(ran)


def test_wrong_password_stops_the_worker_without_printing_it(run: Run) -> None:
    """A wrong password fails start-up, says authentication failed, never prints a password."""
    status, log = run.facts["worker-wrong"]
    assert status != 0
    assert "password authentication failed" in log
    assert " ready." not in log


def test_no_secret_in_logs_or_cli_output(run: Run) -> None:
    """Worker, beat and CLI output, errors included, never contain a password."""
    text = run.workload.logs()
    assert "password authentication failed" in text  # the error paths did run
    assert "cannot use PostgreSQL" in text or "no PostgreSQL connection" in text
    assert [] == [secret for secret in run.facts["secrets"] if secret in text]


def test_no_secret_in_task_results(run: Run) -> None:
    """Stored task results and retry metas (DB errors included) never contain a password."""
    ids = [s.result.id for s in run.workload.sent]
    ids += [r["task_id"] for r in run.workload.executions()]
    retries = json.dumps(run.facts["retry-metas"])
    stored = json.dumps(run.workload.metas(ids)) + retries
    assert "DatabaseUnavailable" in retries or "ServerFull" in retries  # the role's cap
    assert [] == [secret for secret in run.facts["secrets"] if secret in stored]


def test_no_secret_in_reprs_or_exceptions(run: Run) -> None:
    """repr and str of settings, pool, lease, claim and errors never contain the password."""
    found = "\n".join(run.facts["reprs"])
    assert "***" in found
    assert [] == [secret for secret in run.facts["secrets"] if secret in found]
