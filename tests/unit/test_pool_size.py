"""pglock_pool_size: "auto" follows a thread/greenlet worker's concurrency, never a forked child."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest

from celery_pglock._config import Settings
from celery_pglock.errors import ConfigurationError
from celery_pglock.store._database import DEFAULT_POOL_SIZE, pool_size, size_for_worker

DSN = "postgresql://u@127.0.0.1/db"


@pytest.fixture
def auto() -> Iterator[Settings]:
    """Settings with the default pool size; this process's worker sizing undone afterwards."""
    settings = Settings.from_conf({"pglock_dsn": DSN})
    try:
        yield settings
    finally:
        size_for_worker(settings, None)


def test_default_is_auto_and_means_four_outside_a_thread_worker(auto: Settings) -> None:
    """Unset, None and "auto" all mean auto, which is 4 connections in a plain process."""
    assert auto.pool_size is None
    for value in (None, "auto", "AUTO"):
        assert Settings.from_conf({"pglock_dsn": DSN, "pglock_pool_size": value}).pool_size is None
    assert 4 == DEFAULT_POOL_SIZE == pool_size(auto)


def test_auto_follows_the_concurrency_of_tasks_running_in_this_process(auto: Settings) -> None:
    """A threads/gevent/eventlet worker of concurrency 8 gets 9; other pools keep 4."""
    assert 9 == size_for_worker(auto, 8)
    assert 9 == pool_size(auto)

    assert 4 == size_for_worker(auto, None)


def test_explicit_size_is_honoured(auto: Settings) -> None:
    """pglock_pool_size = 3 stays 3 whatever the worker's concurrency."""
    explicit = Settings.from_conf({"pglock_dsn": DSN, "pglock_pool_size": 3})
    assert 3 == size_for_worker(explicit, 8)
    assert 3 == pool_size(explicit)


@pytest.mark.parametrize("value", [0, -1, "many", True, 1.0j])
def test_invalid_size_names_the_setting(value: Any) -> None:
    """A size that is not a positive int or "auto" fails, naming the setting and 'auto'."""
    with pytest.raises(ConfigurationError, match=r"pglock_pool_size must be .*'auto'"):
        Settings.from_conf({"pglock_dsn": DSN, "pglock_pool_size": value})


FORKED = textwrap.dedent(
    """
    import os
    from celery_pglock._config import Settings
    from celery_pglock.store._database import pool_size, size_for_worker

    settings = Settings(dsn="postgresql://u@127.0.0.1/db")
    print("parent", size_for_worker(settings, 8), flush=True)
    child = os.fork()
    if child == 0:
        print("child", pool_size(settings), flush=True)
        os._exit(0)
    os.waitpid(child, 0)
    print("parent-after", pool_size(settings), flush=True)
    """
)


def test_forked_child_does_not_inherit_a_thread_worker_size() -> None:
    """A process forked after sizing for threads (beat, a prefork child) is back to 4."""
    out = subprocess.run(
        [sys.executable, "-c", FORKED], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert ["parent", "9", "child", "4", "parent-after", "9"] == out


HELD_AT_FORK = textwrap.dedent(
    """
    import os, threading, time
    from celery_pglock.store import _database

    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with _database._pools_lock:
            held.set()
            done.wait()

    threading.Thread(target=hold, daemon=True).start()
    held.wait()
    child = os.fork()
    if child == 0:
        got = _database._pools_lock.acquire(timeout=5)
        os._exit(0 if got else 1)
    _, status = os.waitpid(child, 0)
    done.set()
    print("child", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_a_child_forked_while_another_thread_looks_up_a_pool_can_look_up_its_own() -> None:
    """The pools' lock held by another thread at the fork (a heartbeat, beat's election):
    the child (a prefork child, one of beat's senders) has a free lock of its own, not a
    copy held for ever by a thread it does not have."""
    out = subprocess.run(
        [sys.executable, "-c", HELD_AT_FORK], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split()
    assert ["child", "0"] == out
