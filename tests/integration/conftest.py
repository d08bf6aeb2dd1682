"""Fixtures shared by the PostgreSQL tier."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql


@pytest.fixture
def job(pglock_schema: str) -> str:
    """A lock name of this test only: advisory locks are server-wide, schemas are not."""
    return f"{pglock_schema}:job"


@pytest.fixture
def plain_role(pg_dsn: str, pg_conn: psycopg.Connection[Any]) -> Iterator[str]:
    """DSN of a fresh role: LOGIN, no superuser, no CREATEDB, no CREATEROLE."""
    role = f"r_{uuid.uuid4().hex[:12]}"
    pg_conn.execute(
        sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'pw' NOSUPERUSER NOCREATEDB NOCREATEROLE").format(
            sql.Identifier(role)
        )
    )
    try:
        yield psycopg.conninfo.make_conninfo(pg_dsn, user=role, password="pw")  # noqa: S106
    finally:
        pg_conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
        pg_conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
