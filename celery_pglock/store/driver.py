"""The driver's types as the store names them: one ``Connection`` for every module."""

from __future__ import annotations

from typing import Any

import psycopg

Connection = psycopg.Connection[Any]
