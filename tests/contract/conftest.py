"""The stores the contract tests run on: the in-memory twin and real PostgreSQL.

Each test takes ``store``: ``Statements`` and a way to seed the tables the worker and
beat would have written (a run, a beat claim, a skip), on the twin by its ``add_*``
methods, on PostgreSQL by the same rows inserted for real. A test asserts only what both
must answer alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

from celery_pglock import ops
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock.schema import Tables
from celery_pglock.store._memory import InMemoryStatements
from celery_pglock.store.statements import OnConnection, Statements
from tests.contract.lives import life, shared_life  # noqa: F401 - fixtures of the lifecycle tests


class Seeds(Protocol):
    def run(self, lock_name: str, slot: str, state: str, **columns: Any) -> None: ...
    def send(self, namespace: str, entry: str, slot: str, **columns: Any) -> None: ...
    def skip(self, lock_name: str, slot: str, reason: str) -> None: ...
    def disabled(self, namespace: str, entry: str, by: str) -> None: ...


@dataclass
class Store:
    statements: Statements
    seed: Seeds
    kind: str


class TwinSeeds:
    def __init__(self, twin: InMemoryStatements) -> None:
        self.twin = twin

    def run(self, lock_name: str, slot: str, state: str, **columns: Any) -> None:
        self.twin.add_run(lock_name, slot, state, **columns)

    def send(self, namespace: str, entry: str, slot: str, **columns: Any) -> None:
        self.twin.add_send(namespace, entry, slot, **columns)

    def skip(self, lock_name: str, slot: str, reason: str) -> None:
        self.twin.add_skip(lock_name, slot, reason)

    def disabled(self, namespace: str, entry: str, by: str) -> None:
        self.twin.add_disabled(namespace, entry, by)


class PostgresSeeds:
    """The same rows, inserted into the library's tables."""

    def __init__(self, conn: psycopg.Connection[Any], tables: Tables) -> None:
        self.conn = conn
        self.tables = tables

    def _insert(self, table: str, row: dict[str, Any]) -> None:
        query = sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            self.tables.table(table),
            sql.SQL(", ").join(map(sql.Identifier, row)),
            sql.SQL(", ").join(sql.Placeholder() * len(row)),
        )
        values = [Jsonb(value) if isinstance(value, dict) else value for value in row.values()]
        self.conn.execute(query, values)

    def run(self, lock_name: str, slot: str, state: str, **columns: Any) -> None:
        row = {"lock_name": lock_name, "slot": slot, "state": state}
        self._insert("runs", row | {"lock_key": lock_key(lock_name)} | columns)

    def send(self, namespace: str, entry: str, slot: str, **columns: Any) -> None:
        row = {"namespace": namespace, "entry": entry, "slot": slot, "sent_by": "beat"}
        self._insert("beat_sends", row | columns)

    def skip(self, lock_name: str, slot: str, reason: str) -> None:
        self._insert("skips", {"lock_name": lock_name, "slot": slot, "reason": reason})

    def disabled(self, namespace: str, entry: str, by: str) -> None:
        row = {"namespace": namespace, "name": entry, "task": "tasks.x", "enabled": False}
        self._insert("entries", row | {"schedule": {"every": 60}, "version": 1, "changed_by": by})


@pytest.fixture(params=["twin", pytest.param("postgres", marks=pytest.mark.integration)])
def store(request: pytest.FixtureRequest) -> Iterator[Store]:
    if request.param == "twin":
        twin = InMemoryStatements(Tables("contract"))
        yield Store(twin, TwinSeeds(twin), "twin")
        return
    dsn: str = request.getfixturevalue("pg_dsn")
    schema: str = request.getfixturevalue("pglock_schema")
    settings = Settings(dsn=dsn, schema=schema)
    ops.migrate(settings)
    with psycopg.connect(dsn, autocommit=True) as conn:
        statements = OnConnection(conn, settings.tables, settings)
        yield Store(statements, PostgresSeeds(conn, settings.tables), "postgres")
