"""Signals sent by celery-pglock (Celery ``Signal`` objects; connect with ``.connect``).

- ``lock_acquired(sender=task, lock, slot, token)``
- ``task_skipped(sender=task, reason, meta)``: ``meta`` is what the result backend stores.
- ``lock_lost(sender=task name or None, lock, slot, token, cause)``
- ``beat_leader_changed(sender=scheduler, leader, previous)``: ``leader`` is True when this
  replica became the leader, False when it stepped down.
- ``task_overdue(sender=scheduler, entry, slot, overdue_seconds, last_success,
  last_success_at)``: the beat leader found that slot of the entry not succeeded
  ``pglock_overdue_after`` seconds after it fell due; once per slot.
- ``entry_freshness(sender=scheduler, entry, last_success_at, overdue)``: each look of
  the leader's that reads an entry with ``pglock_overdue_after`` (every look up to 1,000
  entries, in turns beyond; the metrics listen to it).
- ``rogue_message(sender=task, origin)``: a message without a slot for a task that a
  PgLockScheduler sends (a stock ``celery beat`` still running?); each one.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

lock_acquired = Signal(name="pglock_lock_acquired")
task_skipped = Signal(name="pglock_task_skipped")
lock_lost = Signal(name="pglock_lock_lost")
beat_leader_changed = Signal(name="pglock_beat_leader_changed")
task_overdue = Signal(name="pglock_task_overdue")
entry_freshness = Signal(name="pglock_entry_freshness")
rogue_message = Signal(name="pglock_rogue_message")
