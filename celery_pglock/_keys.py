"""Lock names and the 64-bit advisory lock keys derived from them.

The key is the first 8 bytes of the SHA-256 digest of the UTF-8 lock name, read as a
big-endian signed 64-bit integer. It is stable across processes, Python versions and
languages; in SQL (PostgreSQL >= 11) the same number is::

    SELECT ('x' || left(encode(sha256(convert_to(:name, 'UTF8')), 'hex'), 16))::bit(64)::bigint;

Python's ``hash()`` is never used: it is salted per process.
"""

from __future__ import annotations

import hashlib

# The ledger's primary key indexes (lock name, slot); a btree entry holds at most 2704
# bytes, so a longer pair would be refused by PostgreSQL at claim time, not here.
MAX_LOCK_NAME_BYTES = 1024


def lock_key(name: str) -> int:
    """Return the advisory lock key (signed 64-bit) for ``name``."""
    check_lock_name(name)
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def lock_keys(name: str, concurrency: int) -> tuple[int, ...]:
    """The ``concurrency`` advisory keys of ``name`` (``pglock_concurrency``): its own key
    first, so that a limit of 1 is the plain lock, then one per further run at once,
    derived from the name and a NUL (never part of a lock name) and the run's number."""
    return (lock_key(name), *(_derived(f"{name}\x00{i}", 8) for i in range(1, concurrency)))


def slot_key(name: str, slot: str) -> int:
    """The advisory key of one slot of ``name``, when a message locks its slot alone
    (``pglock_overlap = "allow"``): copies of the slot exclude each other, other slots
    of the lock name run beside them."""
    return _derived(f"{name}\x00slot-key\x00{slot}", 8)


def slot_lock(name: str, slot: str) -> tuple[int, int]:
    """The two-int advisory key of one slot of ``name`` (under ``pglock_concurrency``)."""
    return _derived(f"{name}\x00slot\x00{slot}", 4), _derived(f"{slot}\x00{name}", 4)


def waiting_lock(name: str) -> tuple[int, int]:
    """The two-int advisory key under which the waiting slot of ``name`` is decided."""
    return _derived(f"{name}\x00waiting", 4), _derived(f"waiting\x00{name}", 4)


def _derived(text: str, size: int) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:size], "big", signed=True)


def check_lock_name(name: object) -> str:
    """Return ``name`` if it can be stored and hashed, else raise a ``ValueError`` that says why."""
    return _checked_text(name, "a lock name", "", MAX_LOCK_NAME_BYTES)


DEFAULT_NAMESPACE = "celery"


def namespace(configured: str | None, app_name: str | None) -> str:
    """A namespace of lock names: ``pglock_namespace``, else the app's main name."""
    return configured or app_name or DEFAULT_NAMESPACE


def default_lock_name(namespace: str, task_name: str) -> str:
    """The lock name of a task that does not set ``pglock_key``."""
    return f"{namespace}:{task_name}"


def entry_lock_name(namespace: str, task_name: str, entry: str) -> str:
    """The lock name of a beat entry's messages when the task is locked app-wide."""
    return f"{namespace}:{task_name}@{entry}"


def leader_lock_name(namespace: str) -> str:
    """The lock the beat replicas of ``namespace`` compete for."""
    return f"{namespace}:beat-leader"


def split_key(key: int) -> tuple[int, int]:
    """The ``(classid, objid)`` pair under which ``pg_locks`` shows a bigint advisory lock."""
    unsigned = key & 0xFFFFFFFFFFFFFFFF
    return unsigned >> 32, unsigned & 0xFFFFFFFF


MAX_SLOT_BYTES = 1024


def check_slot(slot: object) -> str:
    """Return ``slot`` if it is a usable slot id, else raise an error naming the problem."""
    return _checked_text(slot, "a slot", " (e.g. an ISO date or a business key)", MAX_SLOT_BYTES)


def _checked_text(value: object, what: str, example: str, max_bytes: int) -> str:
    """``value`` if it is a string PostgreSQL can store in a key column, else why not."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str{example}, got {type(value).__name__}")
    if not value:
        raise ValueError(f"{what} must not be empty")
    if "\x00" in value:
        raise ValueError(f"{what} must not contain NUL characters (PostgreSQL text cannot)")
    if len(value.encode("utf-8")) > max_bytes:
        raise ValueError(f"{what} must be at most {max_bytes} bytes in UTF-8")
    return value
