"""What a message asks of the lock: its slot, the beat entry that sent it, its coalescing.

Shared by the worker side (``task``) and the caller side (``enqueue``), so both derive the
same slot from the same message.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from celery_pglock._config import TaskOptions
from celery_pglock._keys import check_slot
from celery_pglock.errors import ConfigurationError

SLOT_HEADER = "pglock_slot"
ENTRY_HEADER = "pglock_entry"
# An operator sent this slot by name (trigger, backfill, rerun): it is never superseded by
# newer slots nor late, however old it is.
MANUAL_HEADER = "pglock_manual"
BUILTIN_PREFIX = "celery."  # Celery's own tasks (chord_unlock, backend_cleanup): never locked


def as_headers(value: Any) -> Mapping[str, Any]:
    """Message headers as a mapping: anything else (``apply(headers=...)`` takes whatever
    it is given) counts as no headers."""
    return value if isinstance(value, Mapping) else {}


def headers_of(request: Any) -> Mapping[str, Any]:
    """A request's message headers (see ``as_headers``)."""
    return as_headers(getattr(request, "headers", None))


def coalesces(options: TaskOptions, entry: str | None) -> bool:
    """Whether a message coalesces: ``pglock_coalesce``, by default only beat's messages."""
    if options.coalesce is None:
        return entry is not None
    return options.coalesce == "latest"


def message_slot(
    task: str, options: TaskOptions, header: Any, message_id: str | None, call: tuple[Any, Any]
) -> str | None:
    """A message's slot: its ``pglock_slot`` header, else what ``pglock_slot`` derives
    (the message id, or a function of the task's ``call`` = (args, kwargs))."""
    slot = header
    if slot is None and options.slot == "message":
        slot = message_id
    elif slot is None and callable(options.slot):
        slot = call_option(task, "pglock_slot", options.slot, *call)
    if slot is None:
        return None
    return checked_slot(task, slot)


def checked_slot(task: str, slot: Any) -> str:
    """``slot`` if it is a valid slot, else a ``ConfigurationError`` naming ``task``."""
    try:
        return check_slot(slot)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(f"{task}: invalid slot: {exc}") from None


def call_option(
    task: str, option: str, function: Callable[..., Any], args: Any, kwargs: Any
) -> Any:
    """Call a ``pglock_*`` function option with the task's arguments, errors explained."""
    try:
        return function(*args, **kwargs)
    except Exception as exc:
        raise ConfigurationError(
            f"{task}: the {option} function raised {type(exc).__name__}: {exc}; it receives the "
            "task's positional and keyword arguments (accept **kwargs for the ones it ignores)"
        ) from exc


__all__ = [
    "BUILTIN_PREFIX",
    "ENTRY_HEADER",
    "MANUAL_HEADER",
    "SLOT_HEADER",
    "as_headers",
    "call_option",
    "checked_slot",
    "coalesces",
    "headers_of",
    "message_slot",
]
