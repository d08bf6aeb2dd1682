"""Fixtures shared by the PostgreSQL tier."""

from __future__ import annotations

import pytest


@pytest.fixture
def job(pglock_schema: str) -> str:
    """A lock name of this test only: advisory locks are server-wide, schemas are not."""
    return f"{pglock_schema}:job"
