"""The ``SKIPPED`` task state, and teaching Celery that it is final.

Celery treats unknown states as "not ready", so ``AsyncResult.get()`` on a skipped task
would block until its timeout. Celery has no registry for custom ready states; it reads
``celery.states.READY_STATES`` (and copies of it bound at import time in the result
backends). ``register_ready_state`` extends each of those once, at import of this
package, so ``get()`` returns the skip meta at once and ``ready()`` is true. Skips are
never in ``PROPAGATE_STATES``: a skip is an outcome, not an error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import states as celery_states
from celery.backends import base as backends_base

SKIPPED = "SKIPPED"
#: The state of a message that waits its turn (``pglock_overlap = "buffer_one"``): not
#: ready, so ``AsyncResult.get()`` waits on until the slot runs (``SUCCESS``) or a newer
#: slot replaces it (``SKIPPED``, ``superseded``).
WAITING = "WAITING"

#: Reasons a message is skipped. ``locked``: another execution holds the lock;
#: ``done``: the slot already succeeded; ``superseded``: a newer time slot of the same
#: lock (and beat entry) already succeeded or is running (``pglock_coalesce="latest"``,
#: the default for messages beat sent); ``late``: the time slot was older than
#: ``pglock_max_lateness`` seconds when the message started.
SKIP_REASONS = ("locked", "done", "superseded", "late")


def _with_skipped(states: frozenset[str]) -> frozenset[str]:
    return states | {SKIPPED}


def _patch_default(function: Callable[..., Any], parameter: str) -> None:
    """Add SKIPPED to a ``READY_STATES=...`` default bound when Celery was imported."""
    code = function.__code__
    defaults = function.__defaults__ or ()
    names = code.co_varnames[: code.co_argcount]
    index = names.index(parameter) - (len(names) - len(defaults))
    patched = list(defaults)
    patched[index] = _with_skipped(patched[index])
    function.__defaults__ = tuple(patched)


def register_ready_state() -> None:
    """Make Celery treat ``SKIPPED`` as a ready (final) state. Idempotent."""
    if SKIPPED in celery_states.READY_STATES:
        return
    celery_states.READY_STATES = _with_skipped(celery_states.READY_STATES)
    # On the root class: key-value backends (Redis, cache) derive from Backend, not BaseBackend.
    backends_base.Backend.READY_STATES = celery_states.READY_STATES
    kv = backends_base.BaseKeyValueStoreBackend
    for attribute in ("_filter_ready", "_mget_to_results", "get_many"):
        function = getattr(kv, attribute)
        _patch_default(function, "READY_STATES")


register_ready_state()
