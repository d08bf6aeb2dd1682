-- Named queries of celery-pglock. `-- name: X` starts a query; braces are identifiers
-- (our tables and functions); %(x)s are bound parameters. Each statement is whole: what a
-- call changes comes in its parameters, never as spliced SQL text.

-- name: acquire
-- One round trip for a message with a slot: try the lock (`grant_lock`: with a token,
-- the lease, the session's label and the holder row) and claim the slot's ledger row (a
-- succeeded slot is never claimed). %(xact)s: transaction scope; %(lease_ms)s NULL: no
-- lease. Coalescing (`stale`): a time slot is not claimed when a newer time slot of the
-- same lock (and beat entry) already succeeded (newer_than is our slot, NULL when the
-- policy is off), or when it is older than max_lateness seconds (slot_time). Time slots
-- are fixed-width ISO strings (slot_pattern): they sort as text.
-- The look-up's last two tests sit in a CASE so that the planner does not guess them
-- nearly never true: that guess priced the generic plan so high that, once the ledger
-- had statistics, this statement was planned afresh on every claim (a third slower at
-- a million rows). The CASE changes the estimate, not the result. For the same reason a
-- lock without a slot has a statement of its own (`acquire_mutex`): sharing this one,
-- its cheap plans made PostgreSQL plan every claim afresh.
WITH lock AS MATERIALIZED (
    SELECT * FROM {grant_lock}(%(keys)s::bigint[], %(slot_lock)s::integer[], %(xact)s,
                               %(lease_ms)s, %(application_name)s, %(lock_name)s, %(slot)s,
                               %(task_id)s, %(host)s, %(pid)s, %(concurrency)s)
), stale AS (
    SELECT (SELECT n.slot FROM {runs} n
             WHERE n.lock_name = %(lock_name)s AND n.slot > %(newer_than)s::text
               AND n.state = 'succeeded'
               AND CASE WHEN n.slot ~ %(slot_pattern)s::text
                         AND (%(entry)s::text IS NULL OR n.entry = %(entry)s::text)
                        THEN true END
             ORDER BY n.slot DESC LIMIT 1) AS newer_slot,
           coalesce(%(slot_time)s::timestamptz
                    < now() - make_interval(secs => %(max_lateness)s::float8), false) AS late
), claim AS (
    INSERT INTO {runs} AS r (lock_name, slot, lock_key, state, attempts, token, task_id,
                             task_name, host, pid, backend_pid, started_at, entry)
    SELECT %(lock_name)s, %(slot)s, lock.key, 'running', 1, lock.token, %(task_id)s,
           %(task_name)s, %(host)s, %(pid)s, pg_backend_pid(), now(), %(entry)s
    FROM lock, stale
    WHERE lock.acquired AND stale.newer_slot IS NULL AND NOT stale.late
    ON CONFLICT (lock_name, slot) DO UPDATE
        SET state = 'running', attempts = r.attempts + 1, token = EXCLUDED.token,
            lock_key = EXCLUDED.lock_key, task_id = EXCLUDED.task_id,
            task_name = EXCLUDED.task_name, host = EXCLUDED.host, pid = EXCLUDED.pid,
            backend_pid = EXCLUDED.backend_pid, started_at = now(), finished_at = NULL,
            reason = NULL, updated_at = now(), entry = coalesce(r.entry, EXCLUDED.entry)
        -- Not a slot another live session runs: with pglock_concurrency > 1 the same slot
        -- can arrive twice at once, each message under another of the lock's keys.
        WHERE r.state <> 'succeeded'
          AND NOT (r.state = 'running' AND r.backend_pid IS DISTINCT FROM pg_backend_pid()
                   AND {run_alive}(r.backend_pid, r.lock_key, r.token))
    RETURNING attempts
)
SELECT lock.acquired, lock.key, lock.token, (SELECT attempts FROM claim) AS attempts,
       stale.newer_slot, stale.late
  FROM lock, stale;

-- name: acquire_mutex
-- One round trip for a lock without a slot (mutual exclusion only): `acquire` without
-- the ledger, which such a lock never reads. Columns as `acquire` returns them.
SELECT acquired, key, token, NULL::integer AS attempts, NULL::text AS newer_slot,
       false AS late
  FROM {grant_lock}(%(keys)s::bigint[], %(slot_lock)s::integer[], %(xact)s, %(lease_ms)s,
                    %(application_name)s, %(lock_name)s, %(slot)s, %(task_id)s, %(host)s,
                    %(pid)s, %(concurrency)s);

-- name: wait_lock
-- Wait in the server's lock queue (first come, first served) for the advisory lock, at
-- most %(timeout_ms)s ms ('0': no limit; LockNotAvailable when it runs out), the lease
-- armed in case this process freezes the moment it is granted. `acquire` then claims it
-- on the same connection at once (advisory locks are re-entrant). lock_timeout is put
-- back after the wait: the body of a transaction-scope lock must not inherit it.
WITH armed AS (
    SELECT current_setting('lock_timeout') AS previous,
           set_config('lock_timeout', %(timeout_ms)s, true) AS lock_timeout,
           {set_lease}(%(lease_ms)s, %(xact)s) AS lease
), waited AS (
    SELECT CASE WHEN %(xact)s THEN pg_advisory_xact_lock(%(key)s)
                ELSE pg_advisory_lock(%(key)s) END AS waited
      FROM armed
)
SELECT set_config('lock_timeout', armed.previous, true) AS lock_timeout FROM armed, waited;

-- name: release
-- One round trip: record the outcome (only if this attempt still owns the row) and
-- free the lock. %(held_key)s NULL: unlock_all (the connection is this execution's alone,
-- and a lock the body took on it, even ours again, must not go back to the pool). Else
-- the session is shared by the process's runs (shared.py): free this run's key and, under
-- pglock_concurrency, the slot's own lock it took first (%(slot_lock)s), each once; the
-- session's other locks are other runs'. Disarm the lease so the session may idle
-- (%(disarm_ms)s: the configured value; NULL leaves it: in transaction scope, whose lease
-- ends with the transaction, before PostgreSQL 14, and on a shared session other runs
-- still use) and relabel it (%(idle_application_name)s; NULL leaves it). The unlock is
-- computed from the aggregate over `done`, so it runs after the UPDATE has locked the
-- row: a claimer that gets the lock before our commit waits on that row, then sees
-- `succeeded`.
WITH done AS (
    UPDATE {runs}
       SET state = %(state)s, reason = %(reason)s, finished_at = now(), updated_at = now()
     WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND token = %(token)s
       AND state = 'running'
    RETURNING 1
)
SELECT outcome.recorded,
       CASE WHEN %(held_key)s::bigint IS NULL THEN pg_advisory_unlock_all()::text
            ELSE pg_advisory_unlock(%(held_key)s::bigint)::text END AS released,
       CASE WHEN %(held_key)s::bigint IS NOT NULL AND %(slot_lock)s::integer[] IS NOT NULL
            THEN pg_advisory_unlock((%(slot_lock)s::integer[])[1], (%(slot_lock)s::integer[])[2])
       END AS slot_released,
       {set_lease}(%(disarm_ms)s, false) AS lease,
       CASE WHEN %(idle_application_name)s::text IS NOT NULL
            THEN {label_session}(%(idle_application_name)s) END AS application_name
  FROM (SELECT count(*) AS recorded FROM done) AS outcome;

-- name: release_unwaited
-- The release of a session-scope lock without a slot, sent without waiting for its reply
-- (locks.py): nothing to record. libpq placeholders, as it is sent below psycopg: $1 the
-- session's configured idle_session_timeout (NULL before PostgreSQL 14: no lease to
-- disarm), $2 the pooled application_name.
SELECT pg_advisory_unlock_all(), {set_lease}($1, false), {label_session}($2);

-- name: unlock_shared
-- Free %(keys)s and the slot's own lock on a shared session, which no run of the process
-- holds: a run got the lock but not the slot (done, superseded or late), or its lock
-- statement failed after it may have taken them (a key not held only draws a warning).
SELECT (SELECT count(*) FROM unnest(%(keys)s::bigint[]) AS k
         WHERE pg_advisory_unlock(k)) AS released,
       CASE WHEN %(slot_lock)s::integer[] IS NOT NULL
            THEN pg_advisory_unlock((%(slot_lock)s::integer[])[1], (%(slot_lock)s::integer[])[2])
       END AS slot_released;

-- name: record_outcome
-- After the lock's connection broke: record the outcome on a fresh connection, but only
-- if no later attempt took the row over (same token, still running, or recorded
-- abandoned by `abandon_orphans` in between: its session was gone, the attempt was not).
UPDATE {runs}
   SET state = %(state)s, reason = %(reason)s, finished_at = now(), updated_at = now()
 WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND token = %(token)s
   AND (state = 'running' OR (state = 'failed' AND reason LIKE 'abandoned:%%'))
RETURNING 1;

-- name: restore_success
-- After a failover to a replica that lacked it (asynchronous replication): write back a
-- success this process recorded on the old primary. Only where no other attempt claimed
-- the slot since: the row is missing, or still holds our token (claimed, not finished,
-- or abandoned by the sweep). Returns whether it wrote, and the row as it was before.
WITH restored AS (
    INSERT INTO {runs} AS r (lock_name, slot, lock_key, state, attempts, token, task_id,
                             task_name, host, pid, entry, reason, started_at, finished_at)
    VALUES (%(lock_name)s, %(slot)s, %(key)s, 'succeeded', 1, %(token)s, %(task_id)s,
            %(task_name)s, %(host)s, %(pid)s, %(entry)s,
            'restored after a failover lost it', now(), now())
    ON CONFLICT (lock_name, slot) DO UPDATE
        SET state = 'succeeded', reason = EXCLUDED.reason, finished_at = now(),
            updated_at = now()
        WHERE r.token = EXCLUDED.token AND r.state <> 'succeeded'
    RETURNING 1
)
SELECT (SELECT count(*) FROM restored) AS restored,
       (SELECT state FROM {runs} WHERE lock_name = %(lock_name)s AND slot = %(slot)s),
       (SELECT token FROM {runs} WHERE lock_name = %(lock_name)s AND slot = %(slot)s);

-- name: abandon_orphans
-- Rows left `running` that nothing can finish: the backend that claimed the slot no
-- longer holds its lock (the worker was SIGKILLed or its session ended) and no attempt
-- has claimed the slot since. Recorded `failed`, reason `abandoned: …`: a failed slot is
-- claimed again exactly like such a row, so nothing changes for a redelivery, and the
-- row is final. The beat leader sweeps the oldest %(limit)s at a time; rows another
-- transaction has locked (a release committing) are left for the next sweep.
WITH orphans AS (
    SELECT r.lock_name, r.slot
      FROM {runs} r
     WHERE r.state = 'running' AND NOT {run_alive}(r.backend_pid, r.lock_key, r.token)
     ORDER BY r.started_at
     LIMIT %(limit)s
       FOR UPDATE OF r SKIP LOCKED
)
UPDATE {runs} r
   SET state = 'failed', reason = %(reason)s, finished_at = now(), updated_at = now()
  FROM orphans o
 WHERE r.lock_name = o.lock_name AND r.slot = o.slot
RETURNING r.lock_name, r.slot, r.token, r.task_id, r.host, r.pid;

-- name: record_worker_lost
-- The worker's main process saw the pool child running this message die (SIGKILL, OOM)
-- and the message will not be redelivered: record that child's attempt failed. Only the
-- row this message claimed on this host and still `running`; a later attempt (another
-- task id) that took the slot over is left alone. The child's session, and its lock,
-- ended with the process; a lock it held on rows (the rows backend) is freed here, not
-- when its lease runs out.
WITH failed AS (
    UPDATE {runs}
       SET state = 'failed', reason = %(reason)s, finished_at = now(), updated_at = now()
     WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND task_id = %(task_id)s
       AND host = %(host)s AND state = 'running'
    RETURNING token, lock_key
), freed AS (
    DELETE FROM {row_locks} h USING failed f
     WHERE h.lock_key = f.lock_key AND h.token = f.token
)
SELECT token FROM failed;

-- name: record_failure_after_rollback
-- Transaction scope: the attempt's claim rolled back with the body; record the failed
-- attempt unless another attempt has since claimed or completed the slot.
INSERT INTO {runs} AS r (lock_name, slot, lock_key, state, attempts, token, task_id, task_name,
                         host, pid, started_at, finished_at, reason)
VALUES (%(lock_name)s, %(slot)s, %(key)s, 'failed', 1, %(token)s, %(task_id)s, %(task_name)s,
        %(host)s, %(pid)s, now(), now(), %(reason)s)
ON CONFLICT (lock_name, slot) DO UPDATE
    SET state = 'failed', attempts = r.attempts + 1, token = EXCLUDED.token,
        task_id = EXCLUDED.task_id, host = EXCLUDED.host, pid = EXCLUDED.pid,
        started_at = EXCLUDED.started_at, finished_at = now(), reason = EXCLUDED.reason,
        updated_at = now()
    WHERE r.state IN ('scheduled', 'failed', 'skipped');

-- name: skip
-- Log a skipped message and return what explains it: the slot's run, the newer run that
-- supersedes it (%(newer_slot)s), and the live holder of the lock (from the holders
-- table, or from pg_stat_activity for a transaction-scope holder whose rows are not
-- committed yet). Frees the lock first when this attempt held it (the slot turned out
-- to be done, superseded or late). The reason: `done` if the slot succeeded, else
-- `superseded` if the live holder runs a newer time slot of the same lock (and beat
-- entry) while coalescing (%(newer_than)s), else %(reason)s. %(local_holder)s: the task id
-- of a run of the caller's own process that holds the lock on a session shared with it
-- (shared.py), which the look-up, reading other sessions, cannot name.
WITH released AS (
    SELECT CASE WHEN %(held)s THEN pg_advisory_unlock_all() END AS released
), run AS (
    SELECT state, token, task_id, host, pid, started_at, finished_at
      FROM {runs} WHERE lock_name = %(lock_name)s AND slot = %(slot)s
), holder AS (
    SELECT * FROM (
        -- since: a holder whose statement committed after our snapshot was taken has a
        -- row we cannot see, and no transaction any more: it went idle when it took the lock.
        SELECT l.pid AS backend_pid, a.application_name,
               coalesce(a.xact_start, a.state_change) AS xact_start,
               h.task_id, h.host, h.pid, h.since, h.token, h.slot
          FROM pg_locks l
          JOIN pg_stat_activity a ON a.pid = l.pid
          LEFT JOIN {holders} h ON h.lock_key = %(key)s AND h.backend_pid = l.pid
                -- not a row an earlier run left on this backend (a transaction-scope
                -- holder's own row is uncommitted, and its transaction has an xid)
                AND NOT (a.backend_xid IS NOT NULL AND h.since < a.xact_start)
         WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
           AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (%(keys)s::bigint[])
           AND l.pid <> pg_backend_pid()
        UNION ALL
        -- a holder on rows (the rows lock backend): no session of its own
        SELECT NULL::integer, NULL::text, h.since, h.task_id, h.host, h.pid, h.since,
               h.token, h.slot
          FROM {row_locks} h
         WHERE h.lock_key = ANY (%(keys)s::bigint[]) AND h.expires_at > now()
    ) AS holding
     -- under pglock_concurrency, the one that runs this slot if one does
     ORDER BY slot IS NOT DISTINCT FROM %(slot)s::text DESC
     LIMIT 1
), newer AS (
    SELECT slot, token, task_id, host, pid, finished_at
      FROM {runs} WHERE lock_name = %(lock_name)s AND slot = %(newer_slot)s::text
), ahead AS (
    SELECT 1 FROM holder h
     WHERE h.slot > %(newer_than)s::text AND h.slot ~ %(slot_pattern)s::text
       AND (%(entry)s::text IS NULL OR EXISTS (
            SELECT 1 FROM {runs} e
             WHERE e.lock_name = %(lock_name)s AND e.slot = h.slot AND e.entry = %(entry)s::text))
), abandoned AS (
    -- The slot's row is `running` but its backend no longer holds the lock: a dead attempt
    -- (SIGKILLed worker) that this skipped redelivery would otherwise leave for good.
    UPDATE {runs} r
       SET state = 'failed', reason = %(abandoned_reason)s, finished_at = now(),
           updated_at = now()
     WHERE r.lock_name = %(lock_name)s AND r.slot = %(slot)s AND r.state = 'running'
       AND NOT {run_alive}(r.backend_pid, r.lock_key, r.token)
    RETURNING r.token
), decided AS (
    SELECT CASE WHEN (SELECT state FROM run) = 'succeeded' THEN 'done'
                WHEN EXISTS (SELECT 1 FROM ahead) THEN 'superseded'
                ELSE %(reason)s END AS reason
), logged AS (
    -- Under pglock_overlap = "buffer_one" (%(buffer)s) a `locked` message is not skipped:
    -- it waits its turn (waiting.py), so nothing is logged or finalized here.
    INSERT INTO {skips} (lock_name, slot, reason, task_id, task_name, host, pid, holder_task_id)
    SELECT %(lock_name)s, %(slot)s, decided.reason,
           %(task_id)s, %(task_name)s, %(host)s, %(pid)s,
           -- who held the lock, or ran the slot: for a `done` skip the run that succeeded,
           -- not whichever attempt of another slot holds the lock now
           CASE WHEN (SELECT state FROM run) = 'succeeded' THEN (SELECT task_id FROM run)
                ELSE coalesce((SELECT task_id FROM holder), %(local_holder)s::text,
                              (SELECT task_id FROM newer),
                              (SELECT task_id FROM run)) END
      FROM decided
     WHERE NOT (%(buffer)s AND decided.reason = 'locked')
    RETURNING reason
), finalized AS (
    -- The slot's row is `scheduled` (beat sent it, no attempt ever claimed it) and this
    -- message of it is skipped: nothing else would run the slot, so the row is final,
    -- `skipped` with the skip's reason. A later message of the slot may still claim it.
    UPDATE {runs} r
       SET state = 'skipped', reason = (SELECT reason FROM logged), finished_at = now(),
           updated_at = now()
     WHERE r.lock_name = %(lock_name)s AND r.slot = %(slot)s
       AND r.state IN ('scheduled', 'waiting') AND EXISTS (SELECT 1 FROM logged)
)
SELECT (SELECT reason FROM decided) AS reason,
       (SELECT released FROM released) AS released,
       (SELECT token FROM abandoned) AS abandoned_token,
       run.state AS run_state, run.token AS run_token, run.task_id AS run_task_id,
       run.host AS run_host, run.pid AS run_pid, run.finished_at AS run_finished_at,
       holder.backend_pid, holder.application_name, holder.xact_start,
       holder.task_id AS holder_task_id, holder.host AS holder_host, holder.pid AS holder_pid,
       holder.since AS holder_since, holder.token AS holder_token, holder.slot AS holder_slot,
       newer.slot AS newer_slot, newer.token AS newer_token, newer.task_id AS newer_task_id,
       newer.host AS newer_host, newer.pid AS newer_pid, newer.finished_at AS newer_finished_at
  FROM (SELECT 1) AS one
  LEFT JOIN run ON true
  LEFT JOIN holder ON true
  LEFT JOIN newer ON true;

-- name: enqueue_check
-- Before publishing a slotted message (pglock_check_on_enqueue): has its slot already
-- succeeded, or does a live session run it (its backend holds the lock)? A `running` row
-- whose holder died does not count. Logs the skip only when it finds one, so the usual
-- answer (no row) writes nothing. Columns as `skip` returns them.
WITH run AS (
    SELECT r.state, r.token, r.task_id, r.host, r.pid, r.backend_pid, r.started_at,
           r.finished_at
      FROM {runs} r
     WHERE r.lock_name = %(lock_name)s AND r.slot = %(slot)s
       AND (r.state = 'succeeded'
            OR (r.state = 'running' AND {run_alive}(r.backend_pid, r.lock_key, r.token)))
), logged AS (
    INSERT INTO {skips} (lock_name, slot, reason, task_id, task_name, host, pid, holder_task_id)
    SELECT %(lock_name)s, %(slot)s,
           CASE WHEN state = 'succeeded' THEN 'done' ELSE 'locked' END,
           %(task_id)s, %(task_name)s, %(host)s, %(pid)s, task_id
      FROM run
    RETURNING reason
)
SELECT logged.reason,
       run.token AS run_token, run.task_id AS run_task_id, run.host AS run_host,
       run.pid AS run_pid, run.finished_at AS run_finished_at,
       run.backend_pid, NULL::text AS application_name, NULL::timestamptz AS xact_start,
       run.task_id AS holder_task_id, run.host AS holder_host, run.pid AS holder_pid,
       run.started_at AS holder_since, run.token AS holder_token,
       %(slot)s::text AS holder_slot
  FROM logged, run;

-- name: fence
-- Accept a write with `token` for `resource` unless a larger token already wrote.
INSERT INTO {fences} AS f (resource, token) VALUES (%(resource)s, %(token)s)
ON CONFLICT (resource) DO UPDATE SET token = EXCLUDED.token, updated_at = now()
    WHERE f.token <= EXCLUDED.token
RETURNING token;

-- name: fence_newest
SELECT token FROM {fences} WHERE resource = %(resource)s;

-- name: scheduled_tasks
-- The tasks an active PgLockScheduler leader's entries send (refreshed by it every minute).
SELECT task_name FROM {beat_tasks}
 WHERE namespace = %(namespace)s AND seen_at > now() - make_interval(secs => %(fresh)s);

-- name: record_rogue_send
INSERT INTO {rogue_sends} AS r (namespace, task_name, origin)
VALUES (%(namespace)s, %(task_name)s, %(origin)s)
ON CONFLICT (namespace, task_name, origin) DO UPDATE
    SET last_at = now(), reports = r.reports + 1;
