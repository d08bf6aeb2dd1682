"""Signals sent by celery-pglock (Celery ``Signal`` objects; connect with ``.connect``).

- ``lock_acquired(sender=task, lock, slot, token)``
- ``task_skipped(sender=task, reason, meta)``: ``meta`` is what the result backend stores.
- ``lock_lost(sender=task name or None, lock, slot, token, cause)``
- ``beat_leader_changed(sender=scheduler, leader, previous)``: ``leader`` is True when this
  replica became the leader, False when it stepped down.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="pglock_lock_acquired")
task_skipped = Signal(name="pglock_task_skipped")
lock_lost = Signal(name="pglock_lock_lost")
beat_leader_changed = Signal(name="pglock_beat_leader_changed")
