"""The demo's own table: one row per execution of a task body, written by the body itself.

A body records its start (slot, fencing token, process) and then its outcome in the same
transaction as a fenced write, the way a real task protects its side effect: ``ok`` when
the write was accepted, ``stale`` when a newer holder had already written (the body's
lease had expired while it was frozen). A row left ``running`` is an execution that was
killed. This table is what the report counts; nothing here trusts the library's ledger.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from celery_pglock._fencing import fence
from celery_pglock.errors import StaleToken
from celery_pglock.schema import Tables

EXECUTIONS = "demo_executions"

CREATE_SQL = """
CREATE TABLE IF NOT EXISTS {executions} (
    id          bigserial   PRIMARY KEY,
    run         text        NOT NULL,
    task        text        NOT NULL,
    slot        text        NOT NULL,
    token       bigint,
    task_id     text,
    pid         integer     NOT NULL,
    redelivered boolean     NOT NULL DEFAULT false,
    sent_at     double precision,
    started     timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished    timestamptz,
    outcome     text        NOT NULL DEFAULT 'running'
);
CREATE INDEX IF NOT EXISTS {index} ON {executions} (run, task, slot);
"""
START_SQL = """
INSERT INTO {executions} (run, task, slot, token, task_id, pid, redelivered, sent_at)
VALUES (%(run)s, %(task)s, %(slot)s, %(token)s, %(task_id)s, %(pid)s, %(redelivered)s,
        %(sent_at)s)
RETURNING id
"""
FINISH_SQL = (
    "UPDATE {executions} SET outcome = %(outcome)s, finished = clock_timestamp() WHERE id = %(id)s"
)


def executions_table(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, EXECUTIONS)


def create(conn: psycopg.Connection[Any], schema: str) -> None:
    """Create the executions table in ``schema`` (idempotent)."""
    query = sql.SQL(CREATE_SQL).format(
        executions=executions_table(schema), index=sql.Identifier(f"{EXECUTIONS}_slot_idx")
    )
    conn.execute(query)


class Recorder:
    """Writes one execution's rows; ``token`` None means the task runs without a lock."""

    def __init__(self, dsn: str, schema: str, resource: str, token: int | None) -> None:
        self.dsn = dsn
        self.schema = schema
        self.resource = resource
        self.token = token
        self.tables = Tables(schema)
        self.row_id = 0

    def start(self, **values: Any) -> None:
        """Record the start, after claiming the resource with our token (if any)."""
        query = sql.SQL(START_SQL).format(executions=executions_table(self.schema))
        with psycopg.connect(self.dsn) as conn, conn.transaction():
            self._fence(conn)
            row = conn.execute(query, {**values, "token": self.token}).fetchone()
        self.row_id = int(row[0]) if row else 0

    def finish(self) -> None:
        """Commit the outcome as a fenced write; ``stale`` (and re-raise) if superseded."""
        try:
            with psycopg.connect(self.dsn) as conn, conn.transaction():
                self._fence(conn)
                self._set_outcome(conn, "ok")
        except StaleToken:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                self._set_outcome(conn, "stale")
            raise

    def _fence(self, conn: psycopg.Connection[Any]) -> None:
        if self.token is not None:
            fence(conn, self.resource, self.token, tables=self.tables)

    def _set_outcome(self, conn: psycopg.Connection[Any], outcome: str) -> None:
        query = sql.SQL(FINISH_SQL).format(executions=executions_table(self.schema))
        conn.execute(query, {"outcome": outcome, "id": self.row_id})
