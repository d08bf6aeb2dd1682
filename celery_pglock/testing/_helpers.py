"""Helpers for a project's own tests: point an app at a test schema, deliver a slot
twice, assert that a result was skipped and why. Usable with or without pytest."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from celery_pglock import _config as config
from celery_pglock._messages import SLOT_HEADER
from celery_pglock._states import SKIPPED
from celery_pglock.schema import Tables
from celery_pglock.store._database import close_all
from celery_pglock.store._migrations import ensure_schema


class PgLockDatabase:
    """A schema of its own on a PostgreSQL, with celery-pglock's tables in it."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = schema
        self.tables = Tables(schema)

    def __repr__(self) -> str:
        return f"PgLockDatabase(schema={self.schema!r})"  # the DSN may carry a password

    def configure(self, app: Any) -> Any:
        """Make ``app``'s locked tasks use this schema (its lock names too), from now on."""
        app.conf.update(pglock_dsn=self.dsn, pglock_schema=self.schema)
        app.conf.pglock_namespace = self.schema  # advisory locks are server-wide
        config._app_settings.pop(app, None)  # read again on the next call
        for task in list(app.tasks.values()):
            if getattr(task, "_pglock_options", None) is not None:
                task._pglock_options = None
        return app

    def runs(self) -> list[dict[str, Any]]:
        """The ledger: one row per (lock name, slot), oldest first."""
        return self._rows("SELECT * FROM {runs} ORDER BY created_at, lock_name, slot")

    def skips(self) -> list[dict[str, Any]]:
        """The skipped messages, oldest first."""
        return self._rows("SELECT * FROM {skips} ORDER BY at")

    def _rows(self, query: str) -> list[dict[str, Any]]:
        with psycopg.connect(self.dsn, autocommit=True, row_factory=dict_row) as conn:
            return conn.execute(self.tables.render(query)).fetchall()


@contextmanager
def fresh_database(dsn: str) -> Iterator[PgLockDatabase]:
    """A fresh schema with the tables in it; dropped, with the library's pools closed, after."""
    schema = f"pglock_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn, Tables(schema), auto_migrate=True)
    try:
        yield PgLockDatabase(dsn, schema)
    finally:
        close_all()
        with psycopg.connect(dsn, autocommit=True) as conn:
            drop = sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema))
            conn.execute(drop)


def deliver_twice(
    task: Any, args: Any = (), kwargs: Mapping[str, Any] | None = None, *, slot: str
) -> tuple[Any, Any]:
    """Send two messages of one slot, as a broker redelivery or a second beat would: eager
    (``apply``) when the app runs tasks eagerly, else through the broker. Their results."""
    headers = {SLOT_HEADER: slot}
    eager = bool(task.app.conf.task_always_eager)
    send = task.apply if eager else task.apply_async
    first = send(args, dict(kwargs or {}), headers=headers)
    if not eager:
        first.get(timeout=30, propagate=False)  # the duplicate arrives once the first ran
    return first, send(args, dict(kwargs or {}), headers=headers)


def assert_skipped(
    result: Any,
    reason: str | None = None,
    *,
    slot: str | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Assert that ``result`` (an ``AsyncResult`` or ``EagerResult``) ended ``SKIPPED``, for
    ``reason`` (``done``, ``locked``, ``superseded``, ``late``) and ``slot`` when given;
    returns the skip's meta (``reason``, ``lock``, ``slot``, ``holder``, ``token``)."""
    meta = result.get(timeout=timeout, propagate=False)
    state = result.state
    assert state == SKIPPED, f"expected {SKIPPED}, got {state} ({meta!r})"
    assert isinstance(meta, dict), f"a SKIPPED result carries its meta, got {meta!r}"
    if reason is not None:
        assert meta.get("reason") == reason, f"skipped for {meta.get('reason')!r}, not {reason!r}"
    if slot is not None:
        assert meta.get("slot") == slot, f"skipped slot {meta.get('slot')!r}, not {slot!r}"
    return meta


__all__ = ["PgLockDatabase", "assert_skipped", "deliver_twice", "fresh_database"]
