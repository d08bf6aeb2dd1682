"""The schema's migrations: which version is applied, and applying the missing ones
(``sql/migrations``), under an advisory lock so that concurrent processes do it once."""

from __future__ import annotations

import logging

from psycopg import sql

from celery_pglock import schema
from celery_pglock._keys import lock_key
from celery_pglock.errors import SchemaMissing
from celery_pglock.store._driver import Connection

logger = logging.getLogger("celery_pglock")


def migration_key(tables: schema.Tables) -> int:
    return lock_key(f"celery-pglock:migrate:{tables.schema}.{tables.prefix}")


def current_version(conn: Connection, tables: schema.Tables) -> int | None:
    """The applied schema version, or None when our tables do not exist."""
    qualified = tables.table("schema_version").as_string()
    query = schema.statement("version_table_exists")
    exists = conn.execute(query, {"table": qualified}).fetchone()
    if not exists or not exists[0]:
        return None
    row = conn.execute(tables.query("current_version")).fetchone()
    return row[0] if row else None


def ensure_schema(conn: Connection, tables: schema.Tables, *, auto_migrate: bool) -> None:
    """Create or upgrade our tables (under an advisory lock), or say how to."""
    version = current_version(conn, tables)
    if version is not None and version >= schema.latest_version():
        return
    if not auto_migrate:
        raise SchemaMissing(
            f"celery-pglock tables in schema {tables.schema!r} are missing or outdated "
            f"(version {version}, need {schema.latest_version()}) and pglock_auto_migrate is "
            "off: run `celery -A proj pglock migrate`, or have a DBA apply the SQL printed by "
            "`celery -A proj pglock migrate --sql`"
        )
    apply_migrations(conn, tables)


def apply_migrations(conn: Connection, tables: schema.Tables) -> list[int]:
    """Apply missing migrations in one transaction; concurrent callers wait, then no-op."""
    applied: list[int] = []
    with conn.transaction():
        conn.execute(schema.statement("read_committed"))
        conn.execute(schema.statement("migration_lock"), {"key": migration_key(tables)})
        query = schema.statement("schema_exists")
        exists = conn.execute(query, {"schema": tables.schema}).fetchone()
        if not exists or not exists[0]:
            conn.execute(tables.query("create_schema"))
        conn.execute(tables.query("create_version_table"))
        done = current_version(conn, tables) or 0
        for version, _ in schema.migrations():
            if version > done:
                conn.execute(tables.migration_sql(version).encode())
                conn.execute(tables.query("record_version"), {"version": version})
                applied.append(version)
    if applied:
        logger.info(
            "celery-pglock schema %s migrated to version %d",
            sql.Identifier(tables.schema).as_string(),
            applied[-1],
            extra={"action": "pglock_schema_migrated", "versions": applied},
        )
    return applied
