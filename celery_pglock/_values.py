"""The values settings and task options take: their types, and one check each that
returns the value or raises a ``ConfigurationError`` naming the option and what it takes."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, Literal

from celery_pglock.errors import ConfigurationError

Scope = Literal["session", "transaction"]
OnDbError = Literal["retry", "fail", "run"]
Coalesce = Literal["all", "latest"]
CatchUp = Literal["none", "latest", "all"]
Overlap = Literal["skip", "buffer_one", "allow"]
LockBackend = Literal["auto", "advisory", "rows"]

SCOPES: tuple[Scope, ...] = ("session", "transaction")
ON_DB_ERROR: tuple[OnDbError, ...] = ("retry", "fail", "run")
COALESCE: tuple[Coalesce, ...] = ("all", "latest")
CATCH_UP: tuple[CatchUp, ...] = ("none", "latest", "all")
OVERLAP: tuple[Overlap, ...] = ("skip", "buffer_one", "allow")
LOCK_BACKENDS: tuple[LockBackend, ...] = ("auto", "advisory", "rows")
MAX_CONCURRENCY = 64  # advisory keys tried in turn per claim: keep the claim short


def key_option(key: Any, task_name: str) -> str | Callable[..., str] | None:
    if key is None or callable(key) or (isinstance(key, str) and key):
        return key  # type: ignore[no-any-return]
    raise ConfigurationError(
        f"{task_name}: pglock_key must be a non-empty str or a callable of the task's "
        f"arguments, got {key!r}"
    )


def slot_option(slot: Any, task_name: str) -> str | Callable[..., Any] | None:
    if slot is None or slot == "message" or callable(slot):
        return slot  # type: ignore[no-any-return]
    raise ConfigurationError(
        f"{task_name}: pglock_slot must be None, 'message' (use the task id) or a callable "
        f"of the task's arguments returning the slot, got {slot!r}"
    )


def coalesce(policy: Any, task_name: str) -> Coalesce | None:
    if policy is None or policy in COALESCE:
        return policy  # type: ignore[no-any-return]
    raise ConfigurationError(
        f"{task_name}: pglock_coalesce must be 'all' (run every slot) or 'latest' (skip a slot "
        f"older than one that already succeeded or is running), got {policy!r}"
    )


def overlap(policy: Any, concurrency: Any, task_name: str) -> Overlap | None:
    if policy == "allow" and concurrency not in (None, 1):
        raise ConfigurationError(
            f"{task_name}: pglock_concurrency = {concurrency!r} limits the runs of a lock name "
            "at once, and pglock_overlap = 'allow' sets no limit: drop one of them"
        )
    if policy is None or policy in OVERLAP:
        return policy  # type: ignore[no-any-return]
    raise ConfigurationError(
        f"{task_name}: pglock_overlap must be 'skip' (a slot that finds the lock held is "
        f"skipped), 'buffer_one' (the newest such slot waits and runs next) or 'allow' "
        f"(different slots run at once; only the same slot again is skipped), got {policy!r}"
    )


def concurrency(limit: Any, task_name: str) -> int:
    if limit is None:
        return 1
    if isinstance(limit, int) and not isinstance(limit, bool) and 1 <= limit <= MAX_CONCURRENCY:
        return limit
    raise ConfigurationError(
        f"{task_name}: pglock_concurrency must be an int from 1 to {MAX_CONCURRENCY} (runs of "
        f"one lock name at once), got {limit!r}"
    )


def max_lateness(seconds: Any, task_name: str) -> float | None:
    if seconds is None:
        return None
    return float(positive(seconds, f"{task_name}: pglock_max_lateness"))


def catch_up_option(policy: Any, limit: Any, where: str) -> tuple[CatchUp, int]:
    """A beat catch-up policy and its bound, checked; ``where`` names the setting's owner."""
    if policy not in CATCH_UP:
        raise ConfigurationError(
            f"{where}: pglock_beat_catch_up must be one of {CATCH_UP}, got {policy!r}"
        )
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ConfigurationError(
            f"{where}: pglock_beat_catch_up_limit must be an int >= 1, got {limit!r}"
        )
    return policy, limit


def overdue_option(seconds: Any, where: str) -> float | None:
    """``pglock_overdue_after``, checked: seconds > 0, or None (no freshness alert)."""
    if seconds is None:
        return None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds <= 0:
        raise ConfigurationError(
            f"{where}: pglock_overdue_after must be a number of seconds > 0, or None (off), "
            f"got {seconds!r}"
        )
    return float(seconds)


def lease(lease: Any, task_name: str) -> float | None:
    if lease in (0, False):
        return None  # lease explicitly turned off
    return float(positive(lease, f"{task_name}: pglock_lease"))


def pool_size(value: Any) -> int | None:
    """``pglock_pool_size``: a positive int, or None / "auto" (follow the worker's pool)."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        size = 0 if isinstance(value, bool) else int(value)
    except (TypeError, ValueError):
        size = 0
    if size <= 0:
        raise ConfigurationError(
            f"pglock_pool_size must be a positive int or 'auto', got {value!r}"
        )
    return size


def lock_backend(value: Any) -> LockBackend:
    """``pglock_lock_backend``: "auto" (rows behind a transaction pooler, else advisory),
    "advisory" or "rows"."""
    for backend in LOCK_BACKENDS:
        if value == backend:
            return backend
    raise ConfigurationError(
        f"pglock_lock_backend must be 'auto', 'advisory' or 'rows', got {value!r}"
    )


def idle_timeout(value: Any) -> float | None:
    """``pglock_idle_timeout``: seconds > 0, or 0 (idle connections are kept: None)."""
    if value == 0 and not isinstance(value, bool):
        return None
    return float(positive(value, "pglock_idle_timeout"))


def spare_connections(value: Any) -> int:
    """``pglock_spare_connections``: an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            "pglock_spare_connections must be an int >= 0 (connection slots of the server "
            f"that a process leaves to other clients), got {value!r}"
        )
    return value


def max_retries(value: Any) -> int | None:
    """``pglock_connection_max_retries``: an int >= 0; None or 0 (Celery's meaning) is none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            "pglock_connection_max_retries must be an int >= 0 (failed attempts to reach "
            f"PostgreSQL at start-up before giving up), or None (0 too) to wait for ever; got "
            f"{value!r}"
        )
    return value or None


def senders_option(value: Any) -> int:
    """``pglock_beat_senders``: how many processes share a large tick's sends (1: the
    leader alone); more than one needs ``os.fork``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            "pglock_beat_senders must be an int >= 1 (processes sending a large tick's "
            f"messages; 1: beat's own process alone), got {value!r}"
        )
    if value > 1 and not hasattr(os, "fork"):
        raise ConfigurationError(
            f"pglock_beat_senders = {value} forks sender processes, which this platform "
            "cannot do: set pglock_beat_senders = 1"
        )
    return value


def positive(value: Any, name: str, kind: type = float) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ConfigurationError(f"{name} must be a positive number, got {value!r}") from None
    if number <= 0:
        raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
    return number


def text(value: Any, name: str, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not value and not empty) or "\x00" in value:
        raise ConfigurationError(f"{name} must be a non-empty str without NUL, got {value!r}")
    return value
