"""Lock keys are stable, documented and equal to the SQL formula in the docs."""

from __future__ import annotations

import pytest

from celery_pglock._keys import check_lock_name, check_slot, default_lock_name, lock_key, split_key

# Published test vectors: other tools (SQL, Go, shell) must compute the same numbers.
VECTORS = [
    ("proj:tasks.cleanup", 8934421795825505009),
    ("a", -3848465438864589366),
    ("ünïcödé:task", -4963551108530766703),
]


@pytest.mark.parametrize(("name", "key"), VECTORS)
def test_lock_key_matches_published_vectors(name: str, key: int) -> None:
    """lock_key gives the documented SHA-256-derived number."""
    assert key == lock_key(name)


def test_lock_key_fits_in_bigint() -> None:
    """Every key is a signed 64-bit integer, as pg_advisory_lock(bigint) takes."""
    for i in range(1000):
        assert -(2**63) <= lock_key(f"name-{i}") < 2**63


def test_default_lock_name_is_namespace_and_task() -> None:
    """A task without pglock_key locks on '{namespace}:{task name}'."""
    assert "proj:tasks.cleanup" == default_lock_name("proj", "tasks.cleanup")


def test_split_key_gives_pg_locks_columns() -> None:
    """split_key returns the (classid, objid) pg_locks shows for a bigint key."""
    assert (0xFFFFFFFF, 0xFFFFFFFF) == split_key(-1)
    assert (0, 5) == split_key(5)


@pytest.mark.parametrize(
    ("bad", "error"),
    [("", ValueError), ("a\x00b", ValueError), ("x" * 5000, ValueError), (42, TypeError)],
)
def test_bad_lock_names_are_refused(bad: object, error: type[Exception]) -> None:
    """Empty names, NUL bytes, oversized names and non-strings raise clear errors."""
    with pytest.raises(error):
        check_lock_name(bad)


@pytest.mark.parametrize(
    ("bad", "error"),
    [("", ValueError), ("\x00", ValueError), ("s" * 2000, ValueError), (20261129, TypeError)],
)
def test_bad_slots_are_refused(bad: object, error: type[Exception]) -> None:
    """A slot must be a non-empty string without NUL, at most 1 kB."""
    with pytest.raises(error, match="slot"):
        check_slot(bad)


def test_unicode_slot_is_accepted() -> None:
    """Unicode slots are fine."""
    assert "2026-11-29 ☃" == check_slot("2026-11-29 ☃")
