"""The driver as the store names it: one ``Connection`` for every module, and the few
driver things the modules above the store use, each named once here so that psycopg is
imported by the store alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import psycopg
from psycopg.rows import dict_row as dict_rows
from psycopg.types.json import Jsonb

Connection = psycopg.Connection[Any]

__all__ = ["Connection", "dict_rows", "first_row_of", "json_value"]


def first_row_of(conn: Any, query: bytes, params: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """The first row of ``query`` on a connection the app owns (``fence``'s): the driver's
    own, or any DB-API connection to the same database (psycopg2, Django's)."""
    if isinstance(conn, psycopg.Connection):
        return cast("tuple[Any, ...] | None", conn.execute(query, params).fetchone())
    cursor = conn.cursor()
    try:
        cursor.execute(query.decode("utf-8"), params)
        return cast("tuple[Any, ...] | None", cursor.fetchone())
    finally:
        cursor.close()


def json_value(value: Mapping[str, Any]) -> Jsonb:
    """``value`` as a statement's ``jsonb`` parameter."""
    return Jsonb(value)
