"""SKIPPED is a final state Celery knows about once celery_pglock is imported."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states
from celery.backends.base import Backend, BaseBackend, BaseKeyValueStoreBackend
from celery.backends.cache import CacheBackend
from celery.result import AsyncResult

import celery_pglock
from celery_pglock._protocol import Skip
from celery_pglock._states import SKIP_REASONS, SKIPPED, register_ready_state

META = {
    "reason": "locked",
    "lock": "proj:tasks.cleanup",
    "slot": "2026-11-29T18:05:00Z",
    "holder": {"host": "w1", "pid": 7, "task_id": "abc", "since": "2026-11-29T18:05:00+00:00"},
    "token": 42,
}


@pytest.fixture
def app() -> Iterator[Celery]:
    """An app with an in-memory key-value result backend (the KV code path)."""
    celery = Celery("states", broker="memory://", backend="cache+memory://", set_as_current=False)
    yield celery
    celery.close()


def test_skipped_is_exported_from_the_package() -> None:
    """``from celery_pglock import SKIPPED`` gives the state name stored in the backend."""
    assert "SKIPPED" == celery_pglock.SKIPPED == SKIPPED


@pytest.mark.parametrize("backend", [Backend, BaseBackend, BaseKeyValueStoreBackend, CacheBackend])
def test_skipped_is_a_ready_state_after_import(backend: type[Backend]) -> None:
    """Celery's READY_STATES, and every backend's copy of it, include SKIPPED."""
    assert SKIPPED in states.READY_STATES
    assert SKIPPED in backend.READY_STATES


def test_skipped_is_neither_an_error_nor_propagated() -> None:
    """A skip is an outcome: get() must not raise it, and it is not an exception state."""
    assert SKIPPED not in states.PROPAGATE_STATES
    assert SKIPPED not in states.EXCEPTION_STATES
    assert SKIPPED not in states.UNREADY_STATES


def test_key_value_backend_defaults_include_skipped() -> None:
    """The READY_STATES defaults bound at Celery's import time were extended too."""
    for name in ("_filter_ready", "_mget_to_results", "get_many"):
        function = getattr(BaseKeyValueStoreBackend, name)
        code = function.__code__
        names = code.co_varnames[: code.co_argcount]
        default = dict(zip(reversed(names), reversed(function.__defaults__ or ()), strict=False))
        assert SKIPPED in default["READY_STATES"], name


def test_register_ready_state_is_idempotent() -> None:
    """Registering again changes nothing (imports and reloads may call it more than once)."""
    before = (states.READY_STATES, BaseKeyValueStoreBackend.get_many.__defaults__)

    register_ready_state()

    assert before == (states.READY_STATES, BaseKeyValueStoreBackend.get_many.__defaults__)


def test_skipped_result_is_ready_and_get_returns_its_meta(app: Celery) -> None:
    """A result stored as SKIPPED is ready, not failed, and get() returns the meta at once."""
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, META, SKIPPED)
    result: AsyncResult[Any] = AsyncResult(task_id, app=app)

    assert (True, False, False) == (result.ready(), result.successful(), result.failed())
    assert META == result.get(timeout=2)
    assert SKIPPED == result.state


def test_get_many_returns_skipped_results(app: Celery) -> None:
    """Collecting results (groups, chords) treats SKIPPED as final and returns its meta."""
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, META, SKIPPED)

    backend = app.backend
    assert isinstance(backend, CacheBackend)
    collected = dict(backend.get_many([task_id], timeout=2))

    assert (SKIPPED, META) == (collected[task_id]["status"], collected[task_id]["result"])


def test_skip_reasons_are_the_documented_ones() -> None:
    """The reasons a skip reports are exactly the ones DESIGN.md documents."""
    assert ("locked", "done", "superseded", "late") == SKIP_REASONS


def test_skip_lock_is_a_deprecated_name_of_lock_name() -> None:
    """``Skip.lock`` (0.1) still answers, with a DeprecationWarning naming ``lock_name``."""
    skip = Skip("done", "proj:job", "s", None, 3)

    with pytest.warns(DeprecationWarning, match="Skip.lock_name"):
        assert "proj:job" == skip.lock
