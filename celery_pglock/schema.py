"""SQL text: the packaged migrations and named queries, rendered for one schema and prefix.

Identifiers (schema, table names) only ever enter SQL through ``psycopg.sql.Identifier``;
values only as bound parameters. Rendered queries are cached as bytes per ``Tables``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache, cached_property
from importlib import resources

from psycopg import sql

from celery_pglock.errors import ConfigurationError

TABLES = (
    "runs",
    "tokens",
    "fences",
    "holders",
    "skips",
    "beat",
    "beat_sends",
    "pauses",
    "audit",
    "beat_tasks",
    "rogue_sends",
    "waiting",
    "entries",
    "entry_versions",
    "row_locks",
    "schema_version",
)
# Indexes and constraints: the prefix and the name, unqualified (they live in their table's
# schema).
TABLE_OBJECTS = (
    "runs_updated_idx",
    "runs_running_idx",
    "skips_run_idx",
    "skips_at_idx",
    "beat_sends_unsent_idx",
    "beat_sends_claimed_idx",
    "runs_state_check",
    "audit_slot_idx",
    "runs_lock_created_idx",
    "skips_lock_at_idx",
    "audit_namespace_idx",
    "entries_version_idx",
)
# Functions and statistics objects: schema-qualified and prefixed like the tables.
FUNCTIONS = (
    "runs_entry_stats",
    "skip_counts",
    "holds_lock",
    "next_token",
    "try_lock_any",
    "any_held",
    "grant_lock",
    "set_lease",
    "label_session",
    "row_held",
    "renew_row_lock",
    "run_alive",
    "grant_row_lock",
    "advisory_free",
    "leads",
)
QUERY_FILES = (
    "queries.sql",
    "beat_queries.sql",
    "ops_queries.sql",
    "control_queries.sql",
    "waiting_queries.sql",
    "schema_queries.sql",
    "connection_queries.sql",
    "web_queries.sql",
    "entry_queries.sql",
    "import_queries.sql",
    "row_lock_queries.sql",
)
MAX_PREFIX_LENGTH = 40  # PostgreSQL identifiers stop at 63 bytes; keep room for names.

_QUERY_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
_MIGRATION_FILE = re.compile(r"^(\d{4})_\w+\.sql$")


@cache
def _read(name: str) -> str:
    return resources.files("celery_pglock").joinpath("sql").joinpath(name).read_text("utf-8")


@cache
def query_texts() -> dict[str, str]:
    """Every named query of the packaged ``sql/*queries.sql`` files, by name."""
    texts: dict[str, str] = {}
    where: dict[str, str] = {}
    for filename in QUERY_FILES:
        parts = _QUERY_HEADER.split(_read(filename))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in texts:
                raise ConfigurationError(
                    f"query {name!r} is named twice: in {where[name]} and in {filename}"
                )
            texts[name], where[name] = body.strip(), filename
    return texts


@cache
def migrations() -> tuple[tuple[int, str], ...]:
    """``(version, filename)`` of every packaged migration, in order."""
    folder = resources.files("celery_pglock").joinpath("sql")
    found = (_MIGRATION_FILE.match(entry.name) for entry in folder.iterdir())
    return tuple(sorted((int(m.group(1)), m.group(0)) for m in found if m))


def latest_version() -> int:
    return migrations()[-1][0]


@cache
def statement(name: str) -> bytes:
    """A named statement that names none of our tables (a ping, a setting), as bytes."""
    return sql.SQL(query_texts()[name]).format().as_string().encode("utf-8")


@dataclass(frozen=True)
class Tables:
    """Where celery-pglock's tables live: a schema and a table-name prefix."""

    schema: str = "public"
    prefix: str = "pglock_"

    def __post_init__(self) -> None:
        if len(self.prefix.encode()) > MAX_PREFIX_LENGTH:
            raise ConfigurationError(
                f"pglock_table_prefix must be at most {MAX_PREFIX_LENGTH} bytes, "
                f"got {self.prefix!r}"
            )
        if not self.schema or len(self.schema.encode()) > 63:
            raise ConfigurationError(f"pglock_schema must be 1 to 63 bytes, got {self.schema!r}")
        if "%" in self.schema + self.prefix:  # psycopg would read it as a placeholder
            raise ConfigurationError(
                f"pglock_schema and pglock_table_prefix must not contain '%', "
                f"got {self.schema!r} and {self.prefix!r}"
            )

    def table(self, name: str) -> sql.Identifier:
        """The schema-qualified identifier of one of our tables or sequences."""
        return sql.Identifier(self.schema, self.prefix + name)

    @cached_property
    def identifiers(self) -> dict[str, sql.Composable]:
        names: dict[str, sql.Composable] = {name: self.table(name) for name in TABLES}
        names.update({name: self.table(name) for name in FUNCTIONS})
        names.update({name: sql.Identifier(self.prefix + name) for name in TABLE_OBJECTS})
        names["tokens_regclass"] = sql.Literal(self.table("tokens").as_string())
        names["schema"] = sql.Identifier(self.schema)
        return names

    def render(self, text: str, **fragments: sql.Composable) -> bytes:
        """``text`` with our identifiers and the given fragments filled in, as bytes."""
        composed = sql.SQL(text).format(**self.identifiers, **fragments)
        return composed.as_string().encode("utf-8")

    @cache  # noqa: B019 - Tables are few, frozen and live as long as the process
    def query(self, name: str) -> bytes:
        """A named statement of ``sql/*queries.sql``, whole, for these tables."""
        return self.render(query_texts()[name])

    def migration_sql(self, version: int) -> str:
        """The SQL of one migration with identifiers filled in."""
        filename = dict(migrations())[version]
        return self.render(_read(filename)).decode("utf-8")

    def full_schema_sql(self) -> str:
        """Everything ``migrate`` would run on an empty database, for a DBA to review."""
        parts = [self.query("create_schema").decode(), self.query("create_version_table").decode()]
        record = query_texts()["record_version_in_script"]
        for version, _ in migrations():
            parts.append(self.migration_sql(version))
            parts.append(self.render(record, version=sql.Literal(version)).decode())
        return "\n".join(part.strip() + "\n" for part in parts)
