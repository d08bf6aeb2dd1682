"""What a message locks, by one rule: only a duplicate is ever skipped.

A *duplicate* is the same work again: the same message delivered again (same task id; with
``pglock_slot = "message"`` the task id is the slot), or the same slot of the same lock
name sent again. *Overlap protection*, one run at a time (or ``pglock_concurrency`` runs)
across the different slots of a lock name, is what a beat entry's slots get and what a
task asks for itself (``base=PgLockTask``, ``pglock_key``, ``pglock_overlap``,
``pglock_concurrency``); never a side effect of locking a whole app (``pglock_all_tasks``,
``Celery(task_cls=...)``).

==================  ==================================  ==================================
message             task locked app-wide, asking        task that asked for a lock
                    nothing of overlap (``retrofit``)
==================  ==================================  ==================================
sent by beat        its entry (``<ns>:<task>@<entry>``):  its lock name: each slot once,
(slot and entry)    each slot once, one at a time         one at a time (or as asked)
ad hoc, with slot   that slot alone: once; other slots   its lock name: each slot once,
                    run beside it                        one at a time (or as asked)
ad hoc, no slot     nothing: it runs (``pglock_slot =    its lock name: one at a time
                    "message"``: each task id once)      (``scheduled_only``: nothing)
==================  ==================================  ==================================
"""

from __future__ import annotations

import os
from typing import Any

from celery_pglock._config import TaskOptions
from celery_pglock._keys import lock_key, lock_keys, slot_key
from celery_pglock._messages import coalesces
from celery_pglock._names import lock_name
from celery_pglock._protocol import Claim
from celery_pglock._values import Overlap


def overlap(options: TaskOptions, entry: str | None) -> Overlap:
    """What a message does about the other slots of its lock name: ``skip`` (a run of one
    holds the lock: skipped ``locked``), ``buffer_one`` (the newest waits its turn) or
    ``allow`` (they run beside it: only its own slot is locked). ``entry``: the beat entry
    that sent it."""
    if options.overlap is not None:
        return options.overlap
    if options.retrofit and entry is None:
        return "allow"
    return "skip"


def locks(options: TaskOptions, slot: str | None, entry: str | None) -> bool:
    """Whether a message takes a lock at all: a slotted one always, a slot-less one only
    where its task guards overlap (and does not set ``pglock_scheduled_only``)."""
    if slot is not None:
        return True
    return not options.scheduled_only and overlap(options, entry) != "allow"


def describe(options: TaskOptions) -> str:
    """What a task's messages lock, in words (the worker's start-up line, ``status``)."""
    if options.retrofit:
        return "duplicates only (beat: one at a time per entry)"
    mode = overlap(options, None)
    if mode == "allow":
        return "duplicates only"
    text = "one at a time" if options.concurrency == 1 else f"{options.concurrency} at a time"
    return text + (", the newest slot waits" if mode == "buffer_one" else "")


def claim(
    task_name: str,
    options: TaskOptions,
    call: tuple[Any, Any],
    *,
    slot: str | None,
    entry: str | None,
    task_id: str | None,
    manual: bool = False,
    eager: bool = False,
) -> Claim:
    """The ``Claim`` of one message of ``task_name`` (``call``: its args and kwargs).
    ``manual``: an operator sent this slot by name (never coalesced away nor late);
    ``eager``: called in-process, with no broker to wait on (never buffered)."""
    name = lock_name(task_name, options, *call, entry=entry)
    mode = overlap(options, entry)
    guarded = mode != "allow" or slot is None
    return Claim(
        lock_name=name,
        key=lock_key(name) if guarded else slot_key(name, slot or ""),
        slot=slot,
        task_id=task_id,
        task_name=task_name,
        pid=os.getpid(),
        entry=entry,
        coalesce=not manual and coalesces(options, entry),
        max_lateness=None if manual else options.max_lateness,
        keys=lock_keys(name, options.concurrency) if guarded and options.concurrency > 1 else (),
        buffer=mode == "buffer_one" and slot is not None and not eager,
        per_slot=not guarded,
    )


__all__ = ["claim", "describe", "locks", "overlap"]
