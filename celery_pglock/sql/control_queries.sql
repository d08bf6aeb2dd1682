-- Named queries of the operator controls (celery_pglock/controls.py); see queries.sql
-- for the conventions. Each control writes its audit row in the same transaction.

-- name: control_audit
INSERT INTO {audit} (namespace, action, entry, lock_name, slot, actor, reason, detail)
VALUES (%(namespace)s, %(action)s, %(entry)s, %(lock_name)s, %(slot)s, %(actor)s,
        %(reason)s, %(detail)s)
RETURNING id, at;

-- name: control_pause
-- Pausing a paused entry keeps the first pause (who, when, why): returns nothing then.
INSERT INTO {pauses} (namespace, entry, paused_by, reason)
VALUES (%(namespace)s, %(entry)s, %(actor)s, %(reason)s)
ON CONFLICT (namespace, entry) DO NOTHING
RETURNING entry, paused_by, reason, paused_at;

-- name: control_pauses
SELECT entry, paused_by, reason, paused_at,
       (SELECT count(*) FROM {beat_sends} s
         WHERE s.namespace = p.namespace AND s.entry = p.entry AND s.paused
           AND s.claimed_at >= p.paused_at) AS slots_held_back
  FROM {pauses} p
 WHERE namespace = %(namespace)s
 ORDER BY entry;

-- name: control_resume
DELETE FROM {pauses} WHERE namespace = %(namespace)s AND entry = %(entry)s
RETURNING entry, paused_by, reason, paused_at;

-- name: control_catch_up
-- `resume --catch-up`: the newest %(limit)s slots held back by this pause, to be sent by
-- the operator's command now (oldest first): their claims become sent, their ledger rows
-- go back to `scheduled`.
WITH held AS (
    SELECT s.namespace, s.entry, s.slot, s.lock_name FROM {beat_sends} s
     WHERE s.namespace = %(namespace)s AND s.entry = %(entry)s AND s.paused
       AND s.claimed_at >= %(paused_at)s
     ORDER BY s.slot DESC
     LIMIT %(limit)s
), released AS (
    UPDATE {beat_sends} s
       SET paused = false, sent_at = now(), sent_by = %(actor)s, sends = s.sends + 1
      FROM held h
     WHERE s.namespace = h.namespace AND s.entry = h.entry AND s.slot = h.slot
    RETURNING s.slot, s.lock_name
), rows AS (
    UPDATE {runs} r SET state = 'scheduled', reason = NULL, finished_at = NULL,
                       sent_by = %(actor)s, updated_at = now()
      FROM released x
     WHERE r.lock_name = x.lock_name AND r.slot = x.slot AND r.state = 'paused'
)
SELECT slot FROM released ORDER BY slot;

-- name: control_trigger
-- A manual run: its slot's row is written `scheduled` (sent by the operator) unless the
-- slot already has one; returns the row as it is now (before this statement's insert,
-- NULLs when there was none).
WITH inserted AS (
    INSERT INTO {runs} (lock_name, slot, lock_key, state, entry, sent_by, task_name,
                        scheduled_at)
    VALUES (%(lock_name)s, %(slot)s, %(key)s, 'scheduled', %(entry)s, %(actor)s,
            %(task_name)s, now())
    ON CONFLICT (lock_name, slot) DO NOTHING
    RETURNING state
)
SELECT (SELECT count(*) FROM inserted) AS inserted, r.state, r.token, r.finished_at
  FROM (SELECT 1) AS one
  LEFT JOIN {runs} r ON r.lock_name = %(lock_name)s AND r.slot = %(slot)s;

-- name: control_lock_rows
-- Whether a lock name is known to the ledger at all (both look-ups use an index).
SELECT EXISTS (SELECT 1 FROM {runs} WHERE lock_name = %(lock_name)s)
    OR EXISTS (SELECT 1 FROM {skips} WHERE lock_name = %(lock_name)s) AS known;

-- name: why_run
SELECT lock_name, slot, state, attempts, token, task_id, task_name, host, pid, entry,
       sent_by, reason, created_at, scheduled_at, started_at, finished_at, updated_at
  FROM {runs} WHERE lock_name = %(lock_name)s AND slot = %(slot)s;

-- name: why_sends
SELECT entry, slot, sent_by, sends, claimed_at, sent_at, paused
  FROM {beat_sends}
 WHERE namespace = %(namespace)s AND slot = %(slot)s
   AND (lock_name = %(lock_name)s OR entry = %(entry)s)
 ORDER BY claimed_at;

-- name: why_skips
SELECT at, reason, task_id, task_name, host, pid, holder_task_id
  FROM {skips} WHERE lock_name = %(lock_name)s AND slot = %(slot)s ORDER BY at;

-- name: why_audit
SELECT at, action, entry, lock_name, slot, actor, reason, detail
  FROM {audit}
 WHERE namespace = %(namespace)s
   AND ((lock_name = %(lock_name)s AND slot = %(slot)s)
        OR (slot IS NULL AND entry = %(entry)s))
 ORDER BY at;

-- name: control_slot_rows
SELECT slot, state, token, reason, finished_at FROM {runs}
 WHERE lock_name = %(lock_name)s AND slot = ANY(%(slots)s::text[]);

-- name: control_reopen
-- `rerun`: a succeeded slot is opened again on purpose, as `failed` with who and why, so
-- that the next message of the slot claims it (a new attempt, a larger token). Returns
-- the outcome it had, for the audit row; nothing when the slot has not succeeded.
WITH before AS (
    SELECT lock_name, slot, state, token, task_id, host, pid, started_at, finished_at
      FROM {runs}
     WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND state = 'succeeded'
       FOR UPDATE
), reopened AS (
    UPDATE {runs} r SET state = 'failed', reason = %(reason)s, updated_at = now()
      FROM before b WHERE r.lock_name = b.lock_name AND r.slot = b.slot
)
SELECT state, token, task_id, host, pid, started_at, finished_at FROM before;
