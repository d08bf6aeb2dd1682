"""Statements by name: the one way code above the store talks to PostgreSQL.

A caller names a statement of ``sql/*queries.sql`` and passes its parameters; it gets
rows back as dicts, or one of the library's errors (``errors``), never the driver's. A
mapping among the parameters is sent as JSON (``jsonb``); a list stays an array.

``Statements`` is what the callers see; ``OnConnection`` runs it on one psycopg
connection, and ``celery_pglock.store._memory`` is its in-memory twin for unit tests (the
contract tests in ``tests/contract`` run on both, so the two cannot drift apart).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Protocol

from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from celery_pglock._config import Settings
from celery_pglock.schema import Tables
from celery_pglock.store import _migrations as migrations
from celery_pglock.store._connections import connect
from celery_pglock.store._driver import Connection
from celery_pglock.store._failures import boundary

Row = dict[str, Any]
Params = Mapping[str, Any]


class Statements(Protocol):
    """Named statements on one connection of the app's ``tables``."""

    tables: Tables

    def rows(self, name: str, params: Params | None = None) -> list[Row]:
        """Every row of statement ``name``."""

    def row(self, name: str, params: Params | None = None) -> Row | None:
        """The first row of statement ``name``, None when it returns none."""

    def run(self, name: str, params: Params | None = None) -> int:
        """Run statement ``name`` for its effect: how many rows it changed."""

    def transaction(self) -> AbstractContextManager[None]:
        """The statements inside commit together, or none of them does."""

    def schema_version(self) -> int | None:
        """The applied schema version, None when the library's tables do not exist."""


class OnConnection:
    """``Statements`` on a psycopg connection (autocommit outside ``transaction``).
    ``outage``: any failure is taken for an outage or a misconfiguration, as while
    connecting, never for a statement's own (a start-up read retried until it succeeds)."""

    def __init__(
        self,
        conn: Connection,
        tables: Tables,
        settings: Settings | None = None,
        *,
        outage: bool = False,
    ):
        self.conn = conn
        self.tables = tables
        self._settings = settings
        self._judged = None if outage else conn

    def __repr__(self) -> str:
        return f"<OnConnection {self.tables.schema}.{self.tables.prefix}*>"

    def rows(self, name: str, params: Params | None = None) -> list[Row]:
        with self._boundary(), self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(self.tables.query(name), _bound(params))
            return cur.fetchall() if cur.description is not None else []

    def row(self, name: str, params: Params | None = None) -> Row | None:
        found = self.rows(name, params)
        return found[0] if found else None

    def run(self, name: str, params: Params | None = None) -> int:
        with self._boundary(), self.conn.cursor() as cur:
            return cur.execute(self.tables.query(name), _bound(params)).rowcount

    @contextmanager
    def transaction(self) -> Iterator[None]:
        with self._boundary(), self.conn.transaction():
            yield

    def schema_version(self) -> int | None:
        with self._boundary():
            return migrations.current_version(self.conn, self.tables)

    def ensure_schema(self, *, auto_migrate: bool) -> None:
        """Create or upgrade the library's tables (under an advisory lock), or say how
        (``SchemaMissing``) when ``auto_migrate`` is off."""
        with self._boundary():
            migrations.ensure_schema(self.conn, self.tables, auto_migrate=auto_migrate)

    def migrate(self) -> list[int]:
        """Apply the missing migrations now (``celery pglock migrate``); those applied."""
        with self._boundary():
            return migrations.apply_migrations(self.conn, self.tables)

    def _boundary(self) -> Any:
        return boundary(self._settings, self._judged)


@contextmanager
def adopted(
    conn: Connection, settings: Settings, *, outage: bool = False
) -> Iterator[OnConnection]:
    """Statements on ``conn``, a connection of ``settings``, closed afterwards; the
    driver's errors inside become the library's (``outage``: as ``OnConnection``'s)."""
    with conn, boundary(settings, None if outage else conn):
        yield OnConnection(conn, settings.tables, settings, outage=outage)


@contextmanager
def opened(settings: Settings, *, outage: bool = False, **overrides: Any) -> Iterator[OnConnection]:
    """Statements on a new connection of ``settings`` (``connect``'s ``overrides``)."""
    with adopted(connect(settings, **overrides), settings, outage=outage) as statements:
        yield statements


def _bound(params: Params | None) -> dict[str, Any]:
    """``params`` as the driver takes them: a mapping becomes JSON."""
    return {
        key: Jsonb(value) if isinstance(value, Mapping) else value
        for key, value in (params or {}).items()
    }
