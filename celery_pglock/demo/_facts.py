"""What happened in one demo run, read back from PostgreSQL.

Three sources, each written by a different party: the executions table (by the task
bodies), celery-pglock's skip log (by the workers' lock checks) and its beat send log (by
the beat leader). The report is computed from these rows, never from log lines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from celery_pglock.demo._schedule import TASKS
from celery_pglock.demo._store import executions_table
from celery_pglock.schema import Tables


class Execution(NamedTuple):
    task: str
    slot: str
    outcome: str  # running (never finished: killed), ok, stale (write rejected by fencing)
    pid: int
    token: int | None
    redelivered: bool
    started: float
    finished: float | None


class Skip(NamedTuple):
    task: str
    slot: str
    reason: str


class Send(NamedTuple):
    task: str
    slot: str
    sent_by: str
    sends: int
    sent_at: float | None


@dataclass(frozen=True)
class Facts:
    executions: list[Execution]
    skips: list[Skip]
    sends: list[Send]


EXECUTIONS_SQL = """
SELECT task, slot, outcome, pid, token, redelivered, extract(epoch FROM started)::float8,
       extract(epoch FROM finished)::float8
  FROM {executions} WHERE run = %(run)s ORDER BY id
"""
SKIPS_SQL = """
SELECT substr(lock_name, length(%(prefix)s) + 1), slot, reason
  FROM {skips} WHERE starts_with(lock_name, %(prefix)s) AND slot IS NOT NULL ORDER BY id
"""
SENDS_SQL = """
SELECT entry, slot, sent_by, sends, extract(epoch FROM sent_at)::float8
  FROM {beat_sends} WHERE namespace = %(namespace)s ORDER BY claimed_at
"""
COUNTS_SQL = """
SELECT (SELECT count(*) FROM {executions} WHERE run = %(run)s AND outcome = 'ok'),
       (SELECT count(*) FROM {executions} WHERE run = %(run)s AND outcome = 'running'),
       (SELECT count(*) FROM {skips} WHERE starts_with(lock_name, %(prefix)s))
"""


class Progress(NamedTuple):
    completed: int
    running: int
    skipped: int


class Reader:
    """Reads one run's rows on one connection."""

    def __init__(self, dsn: str, schema: str, run_id: str, namespace: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        self.tables = Tables(schema)
        self.executions = executions_table(schema)
        self.params = {"run": run_id, "namespace": namespace, "prefix": f"{namespace}:"}

    def close(self) -> None:
        self.conn.close()

    def progress(self) -> Progress:
        row = self._rows(COUNTS_SQL)[0]
        return Progress(int(row[0]), int(row[1]), int(row[2]))

    def facts(self) -> Facts:
        return Facts(
            executions=[Execution(*row) for row in self._rows(EXECUTIONS_SQL)],
            skips=[Skip(*row) for row in self._rows(SKIPS_SQL)],
            sends=[Send(_task_of_entry(row[0]), *row[1:]) for row in self._rows(SENDS_SQL)],
        )

    def running(self, task: str) -> list[int]:
        """Pids of the processes running ``task`` right now (newest first)."""
        query = sql.SQL(
            "SELECT pid FROM {} WHERE run = %(run)s AND task = %(task)s AND outcome = 'running' "
            "ORDER BY id DESC"
        ).format(self.executions)
        return [row[0] for row in self.conn.execute(query, {**self.params, "task": task})]

    def running_in(self, pids: list[int]) -> list[str]:
        """Short names of the tasks running in these processes right now."""
        query = sql.SQL(
            "SELECT task FROM {} WHERE run = %(run)s AND outcome = 'running' "
            "AND pid = ANY(%(pids)s) ORDER BY id"
        ).format(self.executions)
        rows = self.conn.execute(query, {**self.params, "pids": pids}).fetchall()
        return [row[0].rsplit(".", 1)[-1] for row in rows]

    def last_sender(self) -> int | None:
        """Pid of the beat that sent the latest slot (``sent_by`` is ``host:pid``)."""
        query = self.tables.render(
            "SELECT sent_by FROM {beat_sends} WHERE namespace = %(namespace)s "
            "ORDER BY claimed_at DESC LIMIT 1"
        )
        row = self.conn.execute(query, self.params).fetchone()
        pid = str(row[0]).rsplit(":", 1)[-1] if row else ""
        return int(pid) if pid.isdigit() else None

    def recent_completed(self, since: float) -> list[tuple[str, str]]:
        """(task, slot) of executions completed since ``since`` (Unix time)."""
        query = sql.SQL(
            "SELECT task, slot FROM {} WHERE run = %(run)s AND outcome = 'ok' "
            "AND finished >= to_timestamp(%(since)s) ORDER BY id"
        ).format(self.executions)
        return [(r[0], r[1]) for r in self.conn.execute(query, {**self.params, "since": since})]

    def _rows(self, text: str) -> list[tuple[Any, ...]]:
        query = sql.SQL(text).format(**self.tables.identifiers, executions=self.executions)
        return self.conn.execute(query, self.params).fetchall()


def _task_of_entry(entry: str) -> str:
    """Beat logs the schedule entry name; the demo names each entry after its task."""
    return next((task.name for task in TASKS if task.short == entry), entry)
