"""A DSN's text: accepted forms, its check, and its password kept out of every line the
library writes."""

from __future__ import annotations

import re

import psycopg.conninfo

from celery_pglock.errors import ConfigurationError

# As libpq reads a URI: user[:password] runs to the first '@' before any '/', so a
# password may hold '?', '#' and ':' unencoded.
_PASSWORD_IN_URL = re.compile(r"(://[^:@/]*:)([^@/]*)(@)")
_PASSWORD_IN_KV = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_SQLALCHEMY_DRIVER = re.compile(r"^(postgres(?:ql)?)\+[a-z0-9_]+://", re.IGNORECASE)


def redact(text: str) -> str:
    """Replace every password in ``text`` (URL or key=value form) with ``***``."""
    text = _PASSWORD_IN_URL.sub(r"\1***\3", text)
    return _PASSWORD_IN_KV.sub(r"\1***", text)


def normalize_dsn(dsn: str) -> str:
    """Accept SQLAlchemy-style ``postgresql+psycopg://`` URLs as libpq ones."""
    return _SQLALCHEMY_DRIVER.sub(r"\1://", dsn.strip())


def check_dsn(dsn: str) -> str:
    """Return ``dsn`` normalized, or raise ``ConfigurationError`` saying what is wrong."""
    dsn = normalize_dsn(dsn)
    try:
        psycopg.conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ConfigurationError(
            f"pglock_dsn {redact(dsn)!r} is not a valid PostgreSQL connection string; "
            "expected e.g. 'postgresql://user@host:5432/dbname'"
        ) from None
    return dsn
