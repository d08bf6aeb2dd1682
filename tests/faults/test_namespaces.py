"""Two apps sharing one schema: ``prune`` and ``release`` of one never touch the other's rows.

App A's namespace holds LIKE wildcards (``_``, ``%``) on purpose: app B's lock names
match it as a pattern, never as text. Rows are aged by hand; B holds a lock of its own.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_pglock import PgLockTask
from celery_pglock._config import Settings
from celery_pglock._keys import lock_key
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Claim, Lease
from celery_pglock.beat import PgLockScheduler
from celery_pglock.cli.command import pglock
from celery_pglock.store._database import Database, close_all, database

pytestmark = pytest.mark.faults

SLOT = "2026-11-29T18:05:00Z"
OLD = 10  # days
ROWS = {
    "runs": "INSERT INTO {runs} (lock_name, slot, lock_key, state, updated_at) "
    "VALUES (%(n)s, %(s)s, %(k)s, 'succeeded', now() - make_interval(days => %(age)s))",
    "skips": "INSERT INTO {skips} (lock_name, slot, reason, at) "
    "VALUES (%(n)s, %(s)s, 'done', now() - make_interval(days => %(age)s))",
    "beat_sends": "INSERT INTO {beat_sends} (namespace, entry, slot, lock_name, sent_by, "
    "claimed_at) VALUES (%(ns)s, 'tick', %(s)s, %(n)s, 'test', "
    "now() - make_interval(days => %(age)s))",
    "holders": "INSERT INTO {holders} (lock_key, lock_name, backend_pid, since) "
    "VALUES (%(k)s, %(n)s, 0, now() - make_interval(days => %(age)s))",
    "row_locks": "INSERT INTO {row_locks} (lock_key, lock_name, token, since, expires_at) "
    "VALUES (%(k)s, %(n)s, 1, now() - make_interval(days => %(age)s), "
    "now() - make_interval(days => %(age)s))",
}


def make_app(dsn: str, schema: str, namespace: str, **conf: Any) -> Celery:
    app = Celery(f"app-{namespace}", set_as_current=False)
    app.conf.update(pglock_dsn=dsn, pglock_schema=schema, pglock_namespace=namespace, **conf)

    @app.task(base=PgLockTask, name="shared.job", shared=False)
    def job() -> None:
        """Never run: only its lock name matters."""

    return app


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(
        pglock, list(args), obj=CLIContext(app=app, no_color=True, workdir=None)
    )


@pytest.fixture
def apps(pg_dsn: str, pglock_schema: str) -> Iterator[tuple[Celery, Celery, Database]]:
    """A (namespace with LIKE wildcards) and B on one schema, each with old rows."""
    a_ns, b_ns = f"{pglock_schema}_a%", f"{pglock_schema}xa-"
    db = database(Settings(dsn=pg_dsn, schema=pglock_schema))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for ns in (a_ns, b_ns):
            name = f"{ns}:shared.job"
            for query in ROWS.values():
                params = {"n": name, "s": SLOT, "k": lock_key(name), "ns": ns, "age": OLD}
                conn.execute(db.tables.render(query), params)
    try:
        yield make_app(pg_dsn, pglock_schema, a_ns), make_app(pg_dsn, pglock_schema, b_ns), db
    finally:
        close_all()


def namespaces_left(db: Database) -> dict[str, list[str]]:
    """Per table, the namespaces (lock-name prefixes) whose rows remain."""
    found = {}
    with psycopg.connect(db.settings.dsn, autocommit=True) as conn:
        for table in ROWS:
            query = db.tables.render(f"SELECT lock_name FROM {{{table}}} ORDER BY 1")
            found[table] = [row[0].rsplit(":", 1)[0] for row in conn.execute(query).fetchall()]
    return found


def test_prune_deletes_only_its_own_namespace(apps: tuple[Celery, Celery, Database]) -> None:
    """`celery pglock prune` of app A leaves every row of app B, whose names match A's LIKE."""
    a, b, db = apps

    result = invoke(a, "prune", "--older-than", "1d", "--json")

    assert 0 == result.exit_code, result.output
    assert dict.fromkeys(ROWS, 1) == json.loads(result.stdout)["deleted"]
    b_ns = b.conf.pglock_namespace
    assert {table: [b_ns] for table in ROWS} == namespaces_left(db)


def test_prune_any_namespace_deletes_every_app_s_rows(
    apps: tuple[Celery, Celery, Database],
) -> None:
    """--any-namespace is the explicit way to prune shared tables for everyone."""
    a, _, db = apps

    result = invoke(a, "prune", "--older-than", "1d", "--any-namespace")

    assert 0 == result.exit_code, result.output
    assert {table: [] for table in ROWS} == namespaces_left(db)


def test_beat_auto_prune_deletes_only_its_own_namespace(
    apps: tuple[Celery, Celery, Database],
) -> None:
    """pglock_ledger_retention prunes from beat within its app's namespace only."""
    a, b, db = apps
    a.conf.update(pglock_ledger_retention="1d", pglock_beat_leader=False, beat_schedule={})
    scheduler = PgLockScheduler(app=a)
    try:
        scheduler.tick()
    finally:
        scheduler.close()

    assert {table: [b.conf.pglock_namespace] for table in ROWS} == namespaces_left(db)


def test_release_refuses_the_other_app_s_lock_and_it_stays_held(
    apps: tuple[Celery, Celery, Database],
) -> None:
    """App A's `release` of a lock app B holds is refused; B keeps it."""
    a, b, db = apps
    name = f"{b.conf.pglock_namespace}:shared.job"
    lease = acquire(db, Claim(name, lock_key(name), None, "b-task", "shared.job"), "session", None)
    assert isinstance(lease, Lease)
    try:
        result = invoke(a, "release", name, "--yes")
        still_held = lease.connection.execute("SELECT 1").fetchone() is not None
    finally:
        release(db, lease, "succeeded")

    assert (2, True) == (result.exit_code, still_held)
    assert "outside this app's namespace" in result.output
