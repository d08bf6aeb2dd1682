-- Named queries of the `buffer_one` overlap policy (celery_pglock/waiting.py); see
-- queries.sql for the conventions. One slot waits per lock name: its row in {waiting}
-- holds the message that runs it, its ledger row is `waiting`.

-- name: lock_waiting
-- One decision at a time per lock name (the two-int key of keys.waiting_lock): two
-- messages buffering at once must not both see "nothing waits" and overwrite each other.
SELECT pg_advisory_xact_lock(%(waiting_lock_1)s, %(waiting_lock_2)s);

-- name: wait_turn
-- A message found every key of its lock held: wait, or not. `taken`: its slot succeeded
-- or a live session runs it (the caller skips it as `done` or `locked`); `superseded`: a
-- newer time slot already waits; else it waits, replacing (and skipping as `superseded`)
-- the slot that waited before it. Returns the outcome, the other waiting slot, and
-- whether that one was still waiting (and is now superseded).
WITH current AS (
    SELECT slot, task_id FROM {waiting} WHERE lock_name = %(lock_name)s
), run AS (
    SELECT state, backend_pid, lock_key, token FROM {runs}
     WHERE lock_name = %(lock_name)s AND slot = %(slot)s
), decided AS (
    SELECT CASE
        WHEN EXISTS (SELECT 1 FROM run
                      WHERE state = 'succeeded'
                         OR (state = 'running' AND {run_alive}(backend_pid, lock_key, token)))
            THEN 'taken'
        WHEN EXISTS (SELECT 1 FROM current c
                      WHERE c.slot > %(slot)s::text AND c.slot ~ %(slot_pattern)s::text
                        AND %(slot)s::text ~ %(slot_pattern)s::text)
            THEN 'superseded'
        ELSE 'waiting' END AS outcome
), kept AS (
    INSERT INTO {waiting} AS w (lock_name, lock_keys, slot, task_id, task_name, entry, body,
                                content_type, content_encoding, headers, exchange,
                                routing_key)
    SELECT %(lock_name)s, %(keys)s::bigint[], %(slot)s, %(task_id)s, %(task_name)s,
           %(entry)s, %(body)s, %(content_type)s, %(content_encoding)s, %(headers)s,
           %(exchange)s, %(routing_key)s
      FROM decided WHERE outcome = 'waiting'
    ON CONFLICT (lock_name) DO UPDATE
        SET lock_keys = EXCLUDED.lock_keys, slot = EXCLUDED.slot, task_id = EXCLUDED.task_id,
            task_name = EXCLUDED.task_name, entry = EXCLUDED.entry, body = EXCLUDED.body,
            content_type = EXCLUDED.content_type,
            content_encoding = EXCLUDED.content_encoding, headers = EXCLUDED.headers,
            exchange = EXCLUDED.exchange, routing_key = EXCLUDED.routing_key,
            waiting_since = CASE WHEN w.slot = EXCLUDED.slot THEN w.waiting_since
                                 ELSE now() END,
            -- a new slot starts its own count towards being given up (MAX_SENDS)
            sends = CASE WHEN w.slot = EXCLUDED.slot THEN w.sends ELSE 0 END,
            sent_at = NULL
    RETURNING 1
), marked AS (
    INSERT INTO {runs} AS r (lock_name, slot, lock_key, state, attempts, task_id, task_name,
                             host, pid, entry)
    SELECT %(lock_name)s, %(slot)s, %(key)s, 'waiting', 0, %(task_id)s, %(task_name)s,
           %(host)s, %(pid)s, %(entry)s
      FROM decided WHERE outcome = 'waiting'
    ON CONFLICT (lock_name, slot) DO UPDATE
        SET state = 'waiting', task_id = EXCLUDED.task_id, task_name = EXCLUDED.task_name,
            host = EXCLUDED.host, pid = EXCLUDED.pid, reason = NULL, finished_at = NULL,
            updated_at = now(), entry = coalesce(r.entry, EXCLUDED.entry)
        WHERE r.state NOT IN ('succeeded', 'running')
), replaced AS (
    -- Only a slot that still waits: its own message may have come back (a retry after a
    -- PostgreSQL restart) and run it since, leaving the waiting row behind; a running slot
    -- is not superseded.
    UPDATE {runs} r
       SET state = 'skipped', reason = 'superseded', finished_at = now(), updated_at = now()
      FROM current c, decided d
     WHERE d.outcome = 'waiting' AND r.lock_name = %(lock_name)s AND r.slot = c.slot
       AND c.slot <> %(slot)s AND r.state = 'waiting'
    RETURNING r.slot, c.task_id
), logged AS (
    INSERT INTO {skips} (lock_name, slot, reason, task_id, task_name, host, pid, holder_task_id)
    SELECT %(lock_name)s, x.slot, 'superseded', x.task_id, %(task_name)s, %(host)s, %(pid)s,
           %(task_id)s
      FROM replaced x
    UNION ALL
    SELECT %(lock_name)s, %(slot)s, 'superseded', %(task_id)s, %(task_name)s, %(host)s,
           %(pid)s, c.task_id
      FROM current c, decided d WHERE d.outcome = 'superseded'
), finalized AS (
    -- superseded before it waited: a slot beat sent (`scheduled`) is final, `skipped`
    UPDATE {runs} r
       SET state = 'skipped', reason = 'superseded', finished_at = now(), updated_at = now()
      FROM decided d
     WHERE d.outcome = 'superseded' AND r.lock_name = %(lock_name)s AND r.slot = %(slot)s
       AND r.state IN ('scheduled', 'waiting')
)
SELECT d.outcome, c.slot AS other_slot, c.task_id AS other_task_id,
       EXISTS (SELECT 1 FROM replaced) AS replaced_waiting
  FROM decided d LEFT JOIN current c ON true;

-- name: send_waiting
-- A holder freed the lock: take the waiting slot's message to send (also one sent more
-- than %(resend_after)s seconds ago that has not started: lost on its way).
UPDATE {waiting}
   SET sent_at = now(), sends = sends + 1
 WHERE lock_name = %(lock_name)s
   AND (sent_at IS NULL OR sent_at < now() - make_interval(secs => %(resend_after)s))
RETURNING task_id, task_name, slot, body, content_type, content_encoding, headers,
          exchange, routing_key;

-- name: replaced_meanwhile
-- A message that just said it waits: did a newer slot replace it meanwhile (the skip row
-- the replacer wrote for it), and which message was that?
SELECT holder_task_id FROM {skips}
 WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND task_id = %(task_id)s
   AND reason = 'superseded'
 ORDER BY at DESC
 LIMIT 1;

-- name: forget_waiting
-- The waiting slot's message started (or was skipped): it waits no more.
DELETE FROM {waiting} WHERE lock_name = %(lock_name)s AND slot = %(slot)s RETURNING task_id;

-- name: stranded_waiting
-- The beat leader's sweep: waiting slots whose lock nobody holds (the holder died before
-- it could send them, or their message was lost on its way), oldest first.
WITH stranded AS (
    SELECT lock_name FROM {waiting}
     WHERE ((sent_at IS NULL AND waiting_since < now() - make_interval(secs => %(grace)s))
            OR sent_at < now() - make_interval(secs => %(resend_after)s))
       AND NOT {any_held}(lock_keys)
     ORDER BY waiting_since
     LIMIT %(limit)s
       FOR UPDATE SKIP LOCKED
)
UPDATE {waiting} w
   SET sent_at = now(), sends = w.sends + 1
  FROM stranded s
 WHERE w.lock_name = s.lock_name
RETURNING w.task_id, w.task_name, w.slot, w.body, w.content_type, w.content_encoding,
          w.headers, w.exchange, w.routing_key;

-- name: abandon_waiting
-- The beat leader's sweep: a waiting slot sent %(max_sends)s times that never started (its
-- task is not registered on any worker, say) waits no more: its ledger row is recorded
-- `failed`, so that it is final; returns what was given up.
WITH given_up AS (
    DELETE FROM {waiting}
     WHERE sends >= %(max_sends)s
       AND sent_at < now() - make_interval(secs => %(resend_after)s)
       AND NOT {any_held}(lock_keys)
    RETURNING lock_name, slot, task_id, task_name, sends
), failed AS (
    UPDATE {runs} r
       SET state = 'failed', reason = %(reason)s, finished_at = now(), updated_at = now()
      FROM given_up g
     WHERE r.lock_name = g.lock_name AND r.slot = g.slot AND r.state = 'waiting'
)
SELECT lock_name, slot, task_id, task_name, sends FROM given_up;

-- name: waiting_slots
-- What status shows: every waiting slot, oldest first.
SELECT lock_name, slot, task_id, task_name, entry, waiting_since, sent_at, sends,
       {any_held}(lock_keys) AS lock_held
  FROM {waiting}
 ORDER BY waiting_since
 LIMIT %(limit)s;
