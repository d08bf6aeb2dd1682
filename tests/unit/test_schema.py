"""SQL rendering: names from settings only ever appear as quoted identifiers (no database)."""

from __future__ import annotations

import re

import pytest
from psycopg import sql

import celery_pglock
from celery_pglock import schema
from celery_pglock.errors import ConfigurationError
from celery_pglock.schema import (
    TABLES,
    Tables,
    latest_version,
    migrations,
    query_texts,
)

HOSTILE_SCHEMA = 'x"; DROP TABLE victim; --'
HOSTILE_PREFIX = "p'q\\\"_"
# What a reader of SQL text must skip to find code: quoted names, strings, comments.
_NOT_CODE = re.compile(r'"(?:[^"]|"")*"|[eE]\'(?:[^\'\\]|\'\'|\\.)*\'|\'(?:[^\']|\'\')*\'|--[^\n]*')
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def code_only(text: str) -> str:
    """``text`` with identifiers, literals and comments blanked out: what the server runs."""
    return _NOT_CODE.sub(" ", text)


# The one statement with a value in braces: the version a DBA's script records, a
# ``psycopg.sql.Literal`` (a script has no parameters).
LITERALS = {"record_version_in_script": {"version"}}


def rendered_queries(tables: Tables) -> dict[str, str]:
    """Every named query rendered for ``tables`` (a literal slot filled with 1)."""
    return {
        name: tables.render(text, **dict.fromkeys(LITERALS.get(name, ()), sql.Literal(1))).decode()
        for name, text in query_texts().items()
    }


@pytest.fixture
def hostile() -> Tables:
    return Tables(HOSTILE_SCHEMA, HOSTILE_PREFIX)


def test_hostile_names_stay_inside_identifiers_in_migrations(hostile: Tables) -> None:
    """A schema or prefix with quotes and SQL never leaks out of its quoted identifier."""
    text = hostile.full_schema_sql()

    assert "DROP TABLE victim" in text
    assert "victim" not in code_only(text)
    # The DROPs of our own: versions 3, 6 and 8 replace the state constraint of the runs table.
    assert ["DROP CONSTRAINT"] * 3 == re.findall(r"DROP \w+", code_only(text))
    assert sql.Identifier(HOSTILE_SCHEMA).as_string() in text


def test_hostile_names_stay_inside_identifiers_in_queries(hostile: Tables) -> None:
    """Every named query quotes the schema and prefix; none of their text becomes code."""
    for name, text in rendered_queries(hostile).items():
        assert "victim" not in code_only(text), name
        assert "p'q" not in code_only(text), name


def test_every_table_is_schema_qualified_and_quoted(hostile: Tables) -> None:
    """Each of our tables is created under its quoted schema and prefixed name."""
    text = hostile.full_schema_sql()

    for name in TABLES:
        assert hostile.table(name).as_string() in text, name


def test_migration_sql_renders_every_placeholder() -> None:
    """The packaged migrations and the DBA script have no placeholder left unfilled."""
    tables = Tables("app", "pglock_")
    texts = [tables.migration_sql(version) for version, _ in migrations()]
    texts.append(tables.full_schema_sql())

    for text in texts:
        assert [] == _PLACEHOLDER.findall(code_only(text))


def test_dba_script_records_the_latest_version() -> None:
    """The printed script ends with the schema at the latest version, as migrate would."""
    text = Tables("app", "pglock_").full_schema_sql()

    assert f"VALUES ({latest_version()})" in text


def test_public_migration_sql_is_the_tables_script() -> None:
    """celery_pglock.migration_sql() is what Tables.full_schema_sql() renders."""
    expected = Tables("ops", "x_").full_schema_sql()

    assert expected == celery_pglock.migration_sql("ops", "x_")


def test_every_named_query_renders() -> None:
    """All named queries render for default names, with no placeholder left behind."""
    for name, text in rendered_queries(Tables()).items():
        assert [] == _PLACEHOLDER.findall(code_only(text)), name


def test_every_statement_is_whole() -> None:
    """A named statement names only our tables and functions in braces: nothing of it is
    spliced in by the caller (every variation comes as a bound parameter)."""
    known = set(Tables().identifiers)
    spliced = {
        name: sorted(set(_PLACEHOLDER.findall(code_only(text))) - known - LITERALS.get(name, set()))
        for name, text in query_texts().items()
    }

    assert {} == {name: keys for name, keys in spliced.items() if keys}


def test_a_query_named_twice_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two statements of one name in the packaged files fail loudly, naming both files."""
    monkeypatch.setattr(schema, "QUERY_FILES", ("queries.sql", "queries.sql"))
    query_texts.cache_clear()
    try:
        with pytest.raises(ConfigurationError, match="'acquire' is named twice"):
            query_texts()
    finally:
        monkeypatch.undo()
        query_texts.cache_clear()


@pytest.mark.parametrize(
    ("schema", "prefix"),
    [("a%sb", "pglock_"), ("app", "p%(key)s_"), ("100%", "x")],
)
def test_percent_in_names_is_refused(schema: str, prefix: str) -> None:
    """A '%' would be read as a query placeholder: refused up front with a clear error."""
    with pytest.raises(ConfigurationError, match="must not contain '%'"):
        Tables(schema, prefix)


def test_overlong_prefix_is_refused() -> None:
    """A prefix that would push table names past PostgreSQL's 63 bytes is refused."""
    with pytest.raises(ConfigurationError, match="pglock_table_prefix"):
        Tables("app", "p" * 41)


@pytest.mark.parametrize("schema", ["", "s" * 64])
def test_bad_schema_length_is_refused(schema: str) -> None:
    """An empty schema name or one longer than 63 bytes is refused."""
    with pytest.raises(ConfigurationError, match="pglock_schema"):
        Tables(schema, "pglock_")
