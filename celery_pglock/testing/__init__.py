"""Tools for test suites (a project's own, ours), the demo and the benchmarks; never
imported by the package core.

- ``assert_skipped``, ``deliver_twice``, ``PgLockDatabase``, ``fresh_database``: helpers
  for a project's tests (``celery_pglock.testing._helpers``);
- the pytest plugin ``celery_pglock`` (``celery_pglock.testing.plugin``): the fixtures
  ``pglock_postgres`` and ``pglock_database``;
- ``celery_pglock.testing.embedded``: a throwaway PostgreSQL server on a loopback port;
- ``celery_pglock.testing._processes``: real processes by pid.
"""

from __future__ import annotations

from celery_pglock.testing._helpers import (
    PgLockDatabase,
    assert_skipped,
    deliver_twice,
    fresh_database,
)

__all__ = ["PgLockDatabase", "assert_skipped", "deliver_twice", "fresh_database"]
