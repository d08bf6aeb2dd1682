"""Schedule entries in PostgreSQL: each change in one place (write, remove), numbered
for beat and audited with its before and after, in one transaction.

Values arrive checked (``_entry_specs``); a change of a namespace takes the namespace's
next change number first, which also makes two changes of it take turns: of two edits of
one entry at once, both are audited and the last one wins. Beat reads the rows changed
since the number it has seen (``changes``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Literal

from celery_pglock._controls import Target, audit
from celery_pglock.errors import ConfigurationError, UnknownEntry
from celery_pglock.ops import Row, jsonable
from celery_pglock.store.statements import Statements

JSON_COLUMNS = ("schedule", "args", "kwargs", "options", "pglock")
Rows = Callable[[str, dict[str, Any]], list[Row]]
Change = Literal["add", "edit", "ensure"]


@dataclass(frozen=True)
class Entry:
    """A stored schedule entry."""

    name: str
    task: str
    schedule: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    pglock: dict[str, Any]
    starts_at: datetime | None
    ends_at: datetime | None
    enabled: bool
    version: int
    changed_by: str
    changed_at: datetime
    removed: bool = False

    @classmethod
    def from_row(cls, row: Row) -> Entry:
        return cls(**{name: row[name] for name in FIELDS})

    @classmethod
    def from_packed(cls, row: Row) -> Entry:
        """An ``entry_changes`` row: its JSON columns packed in one array (``packed``)."""
        row = row | dict(zip(JSON_COLUMNS, json.loads(row["packed"]), strict=True))
        return cls.from_row(row)

    def values(self) -> dict[str, Any]:
        """What a change sets (``write``'s ``values``)."""
        return {name: getattr(self, name) for name in (*JSON_COLUMNS, "task", *WINDOW)}

    def as_json(self) -> Row:
        found: Row = jsonable(
            {f.name: getattr(self, f.name) for f in fields(self) if f.name != "removed"}
        )
        return found


WINDOW = ("starts_at", "ends_at", "enabled")
FIELDS = tuple(f.name for f in fields(Entry))


def get(statements: Statements, namespace: str, name: str) -> Entry | None:
    row = statements.row("entry_get", {"namespace": namespace, "name": name})
    return Entry.from_row(row) if row is not None else None


def listed(statements: Statements, namespace: str) -> list[Entry]:
    rows = statements.rows("entry_list", {"namespace": namespace})
    return [Entry.from_row(row) for row in rows]


def changes(rows: Rows, namespace: str, since: int) -> tuple[int, list[Entry]]:
    """The namespace's newest change number, and the entries changed after ``since``
    (removed ones too), oldest change first; ``rows``: a ``Statements.rows`` (beat's
    statements on the leader's session)."""
    found = rows("entry_version", {"namespace": namespace})
    version = int(found[0]["version"]) if found else 0
    if version <= since:
        return version, []
    changed = rows("entry_changes", {"namespace": namespace, "since": since})
    return version, [Entry.from_packed(row) for row in changed]


def write(
    statements: Statements, target: Target, name: str, values: dict[str, Any], change: Change
) -> Entry:
    """Store ``values`` as entry ``name``: ``add`` refuses a name taken, ``edit`` one not
    there, ``ensure`` takes either. Audited as ``entry_<change>`` with before and after."""
    with statements.transaction():
        version = _next_version(statements, target)
        before = get(statements, target.namespace, name)
        if change == "add" and before is not None:
            raise ConfigurationError(
                f"entry {name!r} exists: change it with `entries edit`, or remove it first"
            )
        if change == "edit" and before is None:
            raise UnknownEntry(f"no entry {name!r} is stored in namespace {target.namespace!r}")
        params = {**values, "namespace": target.namespace, "name": name}
        params |= {column: json.dumps(values[column]) for column in JSON_COLUMNS}
        params |= {"version": version, "changed_by": target.actor}
        row = statements.row("entry_write", params)
        assert row is not None
        after = Entry.from_row(row)
        _audit(statements, target, f"entry_{change}", name, before=before, after=after)
    return after


def remove(statements: Statements, target: Target, name: str) -> Entry:
    """Remove entry ``name`` (beat sends nothing more of it); audited with what it was,
    which it returns."""
    with statements.transaction():
        version = _next_version(statements, target)
        before = get(statements, target.namespace, name)
        if before is None:
            raise UnknownEntry(f"no entry {name!r} is stored in namespace {target.namespace!r}")
        params: dict[str, Any] = {"namespace": target.namespace, "name": name}
        statements.row("entry_remove", params | {"version": version, "changed_by": target.actor})
        _audit(statements, target, "entry_remove", name, before=before, after=None)
    return before


def _next_version(statements: Statements, target: Target) -> int:
    row = statements.row("entry_next_version", {"namespace": target.namespace})
    assert row is not None
    return int(row["version"])


def _audit(
    statements: Statements,
    target: Target,
    action: str,
    name: str,
    *,
    before: Entry | None,
    after: Entry | None,
) -> None:
    audit(
        statements,
        target,
        action,
        entry=name,
        before=before.as_json() if before else None,
        after=after.as_json() if after else None,
    )
