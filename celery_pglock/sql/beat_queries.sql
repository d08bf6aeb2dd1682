-- Named queries of the beat scheduler (see queries.sql for the conventions).

-- name: beat_claim
-- One round trip per tick: claim every due (entry, slot); only rows this call inserted
-- come back, and only those are sent. The run ledger gets a `scheduled` row too, so an
-- operator sees a slot that was sent but never ran. A slot of a paused entry is claimed
-- like any other but comes back `paused`: not sent, its row recorded `paused` with who
-- paused the entry and why. So is a slot of an entry stored in PostgreSQL and disabled
-- (%(stored)s: which entries beat sends are the stored ones, not the code's namesakes).
WITH wanted AS (
    SELECT w.*, p.entry IS NOT NULL OR e.name IS NOT NULL AS paused,
           coalesce('paused by ' || p.paused_by || coalesce(': ' || p.reason, ''),
                    'disabled by ' || e.changed_by) AS pause_reason
      FROM unnest(%(entries)s::text[], %(slots)s::text[], %(lock_names)s::text[],
                  %(keys)s::bigint[], %(tasks)s::text[], %(stored)s::boolean[])
           AS w(entry, slot, lock_name, lock_key, task_name, stored)
      LEFT JOIN {pauses} p ON p.namespace = %(namespace)s AND p.entry = w.entry
      LEFT JOIN {entries} e ON w.stored AND e.namespace = %(namespace)s AND e.name = w.entry
                               AND NOT e.enabled AND NOT e.removed
     -- a leader on rows claims only while its term leads (%(leader_key)s NULL: no fence)
     WHERE {leads}(%(leader_key)s::bigint, %(term)s::bigint)
), claimed AS (
    -- In one order for every replica: `wanted`'s follows the join PostgreSQL picks (a
    -- merge join sorts by entry alone), and two claims inserting the same slots in
    -- opposite orders deadlock (chaos, active-active).
    INSERT INTO {beat_sends} (namespace, entry, slot, lock_name, sent_by, paused)
    SELECT %(namespace)s, entry, slot, lock_name, %(replica)s, paused FROM wanted
     ORDER BY entry, slot
    ON CONFLICT DO NOTHING
    RETURNING entry, slot, paused
), scheduled AS (
    INSERT INTO {runs} (lock_name, slot, lock_key, state, entry, sent_by, task_name,
                        scheduled_at, reason, finished_at)
    SELECT w.lock_name, w.slot, w.lock_key,
           CASE WHEN w.paused THEN 'paused' ELSE 'scheduled' END, w.entry, %(replica)s,
           w.task_name, now(), CASE WHEN w.paused THEN w.pause_reason END,
           CASE WHEN w.paused THEN now() END
      FROM wanted w JOIN claimed c ON c.entry = w.entry AND c.slot = w.slot
    ON CONFLICT (lock_name, slot) DO NOTHING
)
SELECT entry, slot, paused FROM claimed;

-- name: beat_confirm
-- The broker took these messages: mark them sent and advance each entry's state (an
-- entry catching up sends several slots at once: its newest one is its state).
WITH sent AS (
    UPDATE {beat_sends} AS s SET sent_at = now()
      FROM unnest(%(entries)s::text[], %(slots)s::text[]) AS w(entry, slot)
     WHERE s.namespace = %(namespace)s AND s.entry = w.entry AND s.slot = w.slot
)
INSERT INTO {beat} AS b (namespace, entry, last_slot, last_run_at, total_run_count)
SELECT %(namespace)s, entry, max(slot), max(run_at), count(*)
  FROM unnest(%(entries)s::text[], %(slots)s::text[], %(run_ats)s::timestamptz[])
    AS w(entry, slot, run_at)
 GROUP BY entry
ON CONFLICT (namespace, entry) DO UPDATE
    SET last_slot = EXCLUDED.last_slot, last_run_at = EXCLUDED.last_run_at,
        total_run_count = b.total_run_count + EXCLUDED.total_run_count, updated_at = now()
    WHERE b.last_run_at IS NULL OR b.last_run_at <= EXCLUDED.last_run_at;

-- name: beat_unsent
-- Claims whose sender never confirmed them (it died or stopped between claim and
-- confirmation): take them over, one replica each, so they are sent again (%(after)s 0: a
-- new leader takes over every one at once). Workers dedupe by slot.
UPDATE {beat_sends} AS s
   SET sent_by = %(replica)s, claimed_at = now(), sends = s.sends + 1
 WHERE (s.namespace, s.entry, s.slot) IN (
        SELECT namespace, entry, slot FROM {beat_sends}
         WHERE namespace = %(namespace)s AND sent_at IS NULL AND NOT paused
           AND {leads}(%(leader_key)s::bigint, %(term)s::bigint)
           AND claimed_at < now() - make_interval(secs => %(after)s)
           AND claimed_at > now() - make_interval(secs => %(horizon)s)
         ORDER BY claimed_at
         LIMIT %(limit)s
           FOR UPDATE SKIP LOCKED)
RETURNING s.entry, s.slot;

-- name: beat_state
SELECT entry, last_slot, last_run_at, total_run_count FROM {beat} WHERE namespace = %(namespace)s;

-- name: beat_freshness
-- Per watched entry (and its lock name): its newest succeeded time slot, when that run
-- finished, and the oldest slot sent since then that has not succeeded (paused slots
-- aside: a pause is on purpose). Time slots sort as text (slot_pattern).
WITH watched AS (
    SELECT * FROM unnest(%(entries)s::text[], %(lock_names)s::text[]) AS w(entry, lock_name)
), ok AS (
    SELECT w.entry, w.lock_name,
           (SELECT r.slot FROM {runs} r
             WHERE r.lock_name = w.lock_name AND r.state = 'succeeded'
               AND r.slot ~ %(slot_pattern)s::text
             ORDER BY r.slot DESC LIMIT 1) AS last_success
      FROM watched w
)
SELECT ok.entry, ok.last_success,
       (SELECT r.finished_at FROM {runs} r
         WHERE r.lock_name = ok.lock_name AND r.slot = ok.last_success) AS last_success_at,
       (SELECT min(s.slot) FROM {beat_sends} s
         WHERE s.namespace = %(namespace)s AND s.entry = ok.entry AND NOT s.paused
           -- sent under the entry's lock name of today (a new name starts afresh)
           AND s.lock_name = ok.lock_name
           AND s.slot > coalesce(ok.last_success, '') AND s.slot ~ %(slot_pattern)s::text
           AND NOT EXISTS (SELECT 1 FROM {runs} r WHERE r.lock_name = ok.lock_name
                            AND r.slot = s.slot AND r.state = 'succeeded')) AS first_pending,
       (SELECT max(s.slot) FROM {beat_sends} s
         WHERE s.namespace = %(namespace)s AND s.entry = ok.entry) AS last_due
  FROM ok;

-- name: beat_register_tasks
-- The leader's entries, by task (rogue-scheduler warning): refreshed every minute, so a
-- worker can tell an active PgLockScheduler from a stale row.
INSERT INTO {beat_tasks} AS t (namespace, task_name, entry)
SELECT %(namespace)s, task_name, min(entry)
  FROM unnest(%(tasks)s::text[], %(entries)s::text[]) AS w(task_name, entry)
 GROUP BY task_name
ON CONFLICT (namespace, task_name) DO UPDATE SET entry = EXCLUDED.entry, seen_at = now();

-- name: leader_wait
-- A standby waits here, in the server's lock queue, until the leader's session ends.
SELECT pg_advisory_lock(%(key)s);

-- name: leader_arm
-- The new leader: its session labelled (`celery pglock status` says which replica leads)
-- and its lease armed (%(lease_ms)s NULL before PostgreSQL 14: none).
SELECT {label_session}(%(name)s), {set_lease}(%(lease_ms)s, false);

-- name: leader_record
-- The new leader's holder row, once per election (not per tick): `celery pglock status`
-- and the dashboard show who leads and since when (a standby promoted keeps its session,
-- so the session's start is not the election's).
INSERT INTO {holders} AS h (lock_key, lock_name, host, pid, backend_pid)
VALUES (%(key)s, %(lock_name)s, %(host)s, %(pid)s, pg_backend_pid())
ON CONFLICT (lock_key) DO UPDATE
    SET lock_name = EXCLUDED.lock_name, slot = NULL, task_id = NULL, host = EXCLUDED.host,
        pid = EXCLUDED.pid, backend_pid = EXCLUDED.backend_pid, token = NULL, since = now(),
        concurrency = 1;
