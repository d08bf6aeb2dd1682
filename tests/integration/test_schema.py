"""Schema creation: on first use under an advisory lock, opt-out, least privilege, odd names."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

from celery_pglock import migration_sql
from celery_pglock._config import Settings
from celery_pglock._fencing import fence
from celery_pglock._ledger import SUCCEEDED
from celery_pglock._locks import acquire, release
from celery_pglock.errors import SchemaMissing
from celery_pglock.schema import TABLES, migrations
from celery_pglock.store._database import Database, database
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import Procs
from tests.integration.locking import Conn, claim, granted, open_database, the_run

pytestmark = pytest.mark.integration

RACERS = 6
RACER = """
import os, time
from pathlib import Path
from celery_pglock._config import Settings
from celery_pglock.store._database import database

go = Path(os.environ["GO"])
print("READY", flush=True)
while not go.exists():
    time.sleep(0.005)
database(Settings(dsn=os.environ["DSN"], schema=os.environ["SCHEMA"]))
print("MIGRATED", flush=True)
"""


@pytest.fixture
def new_schema(pg_dsn: str, pglock_schema: str) -> Iterator[str]:
    """A schema name that does not exist yet (the library creates it); dropped after."""
    name = f"{pglock_schema}_new"
    try:
        yield name
    finally:
        drop_schema(pg_dsn, name)


def tables_in(conn: Conn, schema: str) -> set[str]:
    """Names of the tables and sequences (not indexes) in ``schema``."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = %s AND c.relkind IN ('r', 'S') AND c.relname NOT LIKE '%%_id_seq'",
        (schema,),
    )
    return {row[0] for row in rows.fetchall()}


def all_versions() -> list[int]:
    """Every migration's version: each is recorded once applied."""
    return [version for version, _ in migrations()]


def versions(conn: Conn, schema: str, prefix: str = "pglock_") -> list[int]:
    table = sql.Identifier(schema, f"{prefix}schema_version")
    rows = conn.execute(sql.SQL("SELECT version FROM {} ORDER BY version").format(table))
    return [row[0] for row in rows.fetchall()]


def our_tables(prefix: str = "pglock_") -> set[str]:
    return {prefix + name for name in TABLES}


@pytest.mark.parametrize("isolation", ["", "serializable"], ids=["default", "serializable"])
def test_concurrent_first_use_creates_schema_once(
    procs: Procs, pg_dsn: str, new_schema: str, pg_conn: Conn, isolation: str
) -> None:
    """Processes starting at once on an empty database all succeed, whatever the isolation."""
    go = procs.log_dir / "go"
    dsn = pg_dsn
    if isolation:  # as a DBA may set database-wide: the migration must not depend on it
        options = f"-c default_transaction_isolation={isolation}"
        dsn = psycopg.conninfo.make_conninfo(pg_dsn, options=options)
    env = {"DSN": dsn, "SCHEMA": new_schema, "GO": str(go)}
    racers = [procs.python("-c", RACER, env=env, name=f"racer{i}") for i in range(RACERS)]
    for racer in racers:
        racer.wait_for_log("READY")

    go.touch()

    assert [0] * RACERS == [racer.wait() for racer in racers]
    assert all("MIGRATED" in racer.log_text() for racer in racers)
    assert all_versions() == versions(pg_conn, new_schema)
    assert our_tables() == tables_in(pg_conn, new_schema)


def test_opening_a_migrated_schema_again_changes_nothing(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """A second start on a migrated schema applies nothing and keeps the data."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema)
    with open_database(settings) as db:
        release(
            db,
            granted(acquire(db, claim(f"{pglock_schema}:job", "s"), "session", None)),
            "succeeded",
        )

    with open_database(settings) as db:
        row = the_run(pg_conn, db, f"{pglock_schema}:job", "s")

    assert all_versions() == versions(pg_conn, pglock_schema)
    assert "succeeded" == row["state"]


def test_auto_migrate_off_on_fresh_schema_names_the_migrate_command(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """With auto-migration off, missing tables raise SchemaMissing naming the fix; none made."""
    db = Database(Settings(dsn=pg_dsn, schema=pglock_schema, auto_migrate=False))

    with pytest.raises(SchemaMissing, match=r"celery -A proj pglock migrate"):
        db.open()

    assert set() == tables_in(pg_conn, pglock_schema)


def test_sql_for_a_dba_satisfies_auto_migrate_off(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """The migration SQL, applied by hand, gives tables that a no-migrate start accepts."""
    pg_conn.execute(migration_sql(pglock_schema).encode())
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, auto_migrate=False)

    with open_database(settings) as db:
        lease = granted(acquire(db, claim(f"{pglock_schema}:job", "s"), "session", None))
        release(db, lease, SUCCEEDED)

    assert all_versions() == versions(pg_conn, pglock_schema)
    assert our_tables() == tables_in(pg_conn, pglock_schema)


@pytest.mark.parametrize("suffix", ["", "_Mixed Case"], ids=["plain", "mixed-case"])
def test_role_without_superuser_can_migrate_and_run(
    plain_role: str, pg_dsn: str, pglock_schema: str, pg_conn: Conn, suffix: str
) -> None:
    """A role with only USAGE and CREATE on its schema creates the tables, locks and fences."""
    schema = pglock_schema + suffix
    role = psycopg.conninfo.conninfo_to_dict(plain_role)["user"]
    if suffix:
        pg_conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    pg_conn.execute(
        sql.SQL("GRANT USAGE, CREATE ON SCHEMA {} TO {}").format(
            sql.Identifier(schema), sql.Identifier(str(role))
        )
    )
    try:
        with open_database(Settings(dsn=plain_role, schema=schema)) as db:
            lease = granted(acquire(db, claim(f"{pglock_schema}:job", "s"), "session", 5.0))
            fence(lease.connection, "report", lease.token, tables=db.tables)
            release(db, lease, SUCCEEDED)
            row = the_run(pg_conn, db, f"{pglock_schema}:job", "s")
    finally:
        if suffix:
            drop_schema(pg_dsn, schema)

    assert ("succeeded", lease.token) == (row["state"], row["token"])


def test_hostile_schema_and_prefix_are_only_ever_names(
    pg_dsn: str, pglock_schema: str, pg_conn: Conn
) -> None:
    """Quotes, backslashes and SQL in the schema and prefix name tables; nothing else runs."""
    victim = sql.Identifier(pglock_schema, "victim")
    pg_conn.execute(sql.SQL("CREATE TABLE {} (id int)").format(victim))
    schema = f'{pglock_schema}"; DROP TABLE {pglock_schema}.victim; --'
    prefix = "p'q\\\"_"
    try:
        with open_database(Settings(dsn=pg_dsn, schema=schema, table_prefix=prefix)) as db:
            lease = granted(acquire(db, claim(f"{pglock_schema}:job", "s"), "session", 5.0))
            fence(lease.connection, "report", lease.token, tables=db.tables)
            release(db, lease, SUCCEEDED)
            row = the_run(pg_conn, db, f"{pglock_schema}:job", "s")
        created = tables_in(pg_conn, schema)
    finally:
        drop_schema(pg_dsn, schema)

    assert "succeeded" == row["state"]
    assert our_tables(prefix) == created
    assert (0,) == pg_conn.execute(sql.SQL("SELECT count(*) FROM {}").format(victim)).fetchone()


def test_process_wide_database_is_shared_per_settings(pg_dsn: str, pglock_schema: str) -> None:
    """database() opens one pool per settings in a process and hands the same one out."""
    settings = Settings(dsn=pg_dsn, schema=pglock_schema)

    first = database(settings)
    try:
        assert first is database(Settings(dsn=pg_dsn, schema=pglock_schema))
    finally:
        first.close()
