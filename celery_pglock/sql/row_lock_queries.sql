-- Named queries of the rows lock backend (see 0012_row_locks.sql and queries.sql for the
-- conventions). Each is one statement, one transaction: a transaction pooler may run the
-- next one on another server session, and nothing here needs the same one again.

-- name: acquire_rows
-- `acquire` on rows: take the lock (`grant_row_lock`: a free key and a fencing token),
-- claim the slot's ledger row as `acquire` does (backend_pid NULL: the attempt is alive
-- while its token's row is, `run_alive`), and hold the key with a row that expires at the
-- server's now() + %(lease_s)s, only if the slot was claimed (a lock without a slot,
-- always). Columns as `acquire` returns them, `expires_at` of the row held, and, when the
-- lock was not granted, `own_expires_at`/`own_seconds_left` of an unexpired row of this
-- very task id that holds it (a redelivery's own earlier attempt: locks._own_attempt_died).
WITH lock AS MATERIALIZED (
    SELECT * FROM {grant_row_lock}(%(keys)s::bigint[], %(slot_lock)s::integer[],
                                   %(lock_name)s, %(slot)s)
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
           %(task_name)s, %(host)s, %(pid)s, NULL, now(), %(entry)s
    FROM lock, stale
    WHERE lock.acquired AND %(slot)s::text IS NOT NULL
      AND stale.newer_slot IS NULL AND NOT stale.late
    ON CONFLICT (lock_name, slot) DO UPDATE
        SET state = 'running', attempts = r.attempts + 1, token = EXCLUDED.token,
            lock_key = EXCLUDED.lock_key, task_id = EXCLUDED.task_id,
            task_name = EXCLUDED.task_name, host = EXCLUDED.host, pid = EXCLUDED.pid,
            backend_pid = NULL, started_at = now(), finished_at = NULL,
            reason = NULL, updated_at = now(), entry = coalesce(r.entry, EXCLUDED.entry)
        WHERE r.state <> 'succeeded'
          AND NOT (r.state = 'running' AND {run_alive}(r.backend_pid, r.lock_key, r.token))
    RETURNING attempts
), held AS (
    INSERT INTO {row_locks} AS h (lock_key, lock_name, slot, task_id, host, pid, token,
                                  concurrency, expires_at)
    SELECT lock.key, %(lock_name)s, %(slot)s, %(task_id)s, %(host)s, %(pid)s, lock.token,
           %(concurrency)s, now() + make_interval(secs => %(lease_s)s::float8)
      FROM lock
     WHERE lock.acquired AND (%(slot)s::text IS NULL OR EXISTS (SELECT 1 FROM claim))
    ON CONFLICT (lock_key) DO UPDATE
        SET lock_name = EXCLUDED.lock_name, slot = EXCLUDED.slot, task_id = EXCLUDED.task_id,
            host = EXCLUDED.host, pid = EXCLUDED.pid, token = EXCLUDED.token,
            concurrency = EXCLUDED.concurrency, since = now(), expires_at = EXCLUDED.expires_at
    RETURNING h.expires_at
), own AS (
    SELECT h.expires_at, extract(epoch FROM h.expires_at - now())::float8 AS seconds_left
      FROM {row_locks} h, lock
     WHERE NOT lock.acquired AND h.lock_key = ANY (%(keys)s::bigint[])
       AND h.task_id = %(task_id)s AND h.expires_at > now()
     ORDER BY h.expires_at DESC
     LIMIT 1
)
SELECT lock.acquired, lock.key, lock.token, (SELECT attempts FROM claim) AS attempts,
       stale.newer_slot, stale.late, (SELECT expires_at FROM held) AS expires_at,
       (SELECT expires_at FROM own) AS own_expires_at,
       (SELECT seconds_left FROM own) AS own_seconds_left
  FROM lock, stale;

-- name: own_row_lock
-- The unexpired row of %(task_id)s holding one of %(keys)s: a redelivered message's own
-- earlier attempt, looked at again while it waits (see locks._own_attempt_died).
SELECT expires_at
  FROM {row_locks}
 WHERE lock_key = ANY (%(keys)s::bigint[]) AND task_id = %(task_id)s AND expires_at > now()
 ORDER BY expires_at DESC
 LIMIT 1;

-- name: renew_row_lock
-- The heartbeat: the row's expiry pushed to now() + %(lease_s)s while it is still this
-- token's and unexpired; `expires_at` NULL: the lock is lost (see the function).
SELECT {renew_row_lock}(%(key)s, %(token)s, %(lease_s)s::float8) AS expires_at;

-- name: release_rows
-- `release` on rows: record the outcome (only if this attempt still owns the slot's row)
-- and delete the lock's row (only if it is still this token's), in one transaction: a
-- claimer that finds the key free finds the slot final too. `held`: the row was still
-- ours, unexpired (0: the lease ran out first, or another holder took the key over).
WITH done AS (
    UPDATE {runs}
       SET state = %(state)s, reason = %(reason)s, finished_at = now(), updated_at = now()
     WHERE lock_name = %(lock_name)s AND slot = %(slot)s AND token = %(token)s
       AND state = 'running'
    RETURNING 1
), freed AS (
    DELETE FROM {row_locks}
     WHERE lock_key = %(key)s AND token = %(token)s
    RETURNING expires_at > now() AS unexpired
)
SELECT (SELECT count(*) FROM done) AS recorded,
       (SELECT count(*) FROM freed WHERE unexpired) AS held;

-- name: lock_free
-- Whether no one holds any of %(keys)s (on an advisory lock or on rows): a wait on rows
-- looks with it before it tries the lock.
SELECT NOT {any_held}(%(keys)s::bigint[]) AS free;

-- name: row_held
-- Whether an unexpired row holds %(key)s: a replica elected on an advisory lock waits for
-- a leader elected on rows to expire before it leads.
SELECT {row_held}(%(key)s) AS held;

-- name: prune_row_locks
-- One batch of expired row locks older than the cutoff: one row per key ever held on
-- rows, as with `holders`; an unexpired one is a holder and is kept however old.
DELETE FROM {row_locks} AS h
 USING (SELECT o.lock_key FROM {row_locks} o
         WHERE o.since < now() - make_interval(secs => %(seconds)s)
           AND o.expires_at < now()
           AND (%(prefix)s::text IS NULL OR o.lock_name LIKE %(prefix)s::text)
         LIMIT %(batch)s
           FOR UPDATE OF o SKIP LOCKED) AS old
 WHERE h.lock_key = old.lock_key;
