"""The driver as the store names it: one ``Connection`` for every module, and the few
driver things the modules above the store use, each named once here so that psycopg is
imported by the store alone."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.rows import dict_row as dict_rows
from psycopg.types.json import Jsonb

Connection = psycopg.Connection[Any]

__all__ = ["Connection", "dict_rows", "is_connection", "json_value"]


def is_connection(conn: object) -> bool:
    """Whether ``conn`` is the driver's own connection (not another DB-API one)."""
    return isinstance(conn, psycopg.Connection)


def json_value(value: Mapping[str, Any]) -> Jsonb:
    """``value`` as a statement's ``jsonb`` parameter."""
    return Jsonb(value)
