"""Fencing tokens: make a downstream write reject a holder that was superseded.

Every granted attempt gets a token from one sequence, so a later holder always has a
larger token. ``fence`` records the largest token that wrote to a resource; a write with a
smaller one raises ``StaleToken``. Call it in the same transaction as the protected write,
so the check and the write commit (or roll back) together.
"""

from __future__ import annotations

from typing import Any

from celery_pglock._config import tables_of
from celery_pglock.errors import StaleToken
from celery_pglock.schema import Tables
from celery_pglock.store._driver import first_row_of


def fence(conn: Any, resource: str, token: int, *, tables: Tables | None = None) -> None:
    """Accept this write for ``resource`` under ``token``, or raise ``StaleToken``.

    ``conn`` is a psycopg 3 connection, or any DB-API connection to the same database
    (psycopg2, Django's ``connection``). The tables default to the current Celery app's
    ``pglock_schema`` / ``pglock_table_prefix``.
    """
    tables = tables or default_tables()
    params = {"resource": resource, "token": int(token)}
    if first_row_of(conn, tables.query("fence"), params) is None:
        newest = first_row_of(conn, tables.query("fence_newest"), {"resource": resource})
        raise StaleToken(resource, int(token), newest[0] if newest else None)


def default_tables() -> Tables:
    """Our tables as the current Celery app configures them (or the defaults)."""
    from celery import current_app  # noqa: PLC0415 - only needed when no tables are given

    return tables_of(current_app.conf)
