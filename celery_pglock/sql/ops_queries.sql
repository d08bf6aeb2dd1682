-- Named queries of the operator commands (`celery pglock status|runs|prune|release`);
-- see queries.sql for the conventions. Reads take no row locks; prune deletes in small
-- batches with SKIP LOCKED, so it never waits on a claim and never blocks one for long.
-- A bigint advisory lock shows in pg_locks as classid = high 32 bits, objid = low 32
-- bits, objsubid = 1 (keys.split_key).

-- name: ops_locks
-- Every advisory lock held or awaited in this database whose key this app knows (its
-- holders table, or the lock names passed in) or whose session celery-pglock labelled
-- (application_name), with the session and, for session-scope holders, the holder row.
-- `recorded`: the holder row describes the current holder. A transaction-scope holder's
-- own row update is invisible until it commits; what we see then is an older run's row
-- (same backend, written before the current transaction, which has written: an xid).
WITH known AS (
    SELECT k.lock_key, k.lock_name
      FROM unnest(%(keys)s::bigint[], %(names)s::text[]) AS k(lock_key, lock_name)
), locks AS (
    SELECT (l.classid::bigint << 32) | l.objid::bigint AS lock_key, l.pid, l.granted
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.pid <> pg_backend_pid()
)
SELECT l.lock_key, l.granted, l.pid AS backend_pid,
       coalesce(h.lock_name, k.lock_name) AS lock_name,
       a.application_name, host(a.client_addr) AS client_addr, a.usename,
       a.backend_start, a.xact_start, a.query_start,
       (h.backend_pid = l.pid AND l.granted AND h.since >= a.backend_start
        AND NOT (a.backend_xid IS NOT NULL AND h.since < a.xact_start)) AS recorded,
       h.task_id, h.host, h.pid, h.slot, h.token, h.since, h.concurrency,
       NULL::timestamptz AS expires_at
  FROM locks l
  JOIN pg_stat_activity a ON a.pid = l.pid
  LEFT JOIN {holders} h ON h.lock_key = l.lock_key
  LEFT JOIN known k ON k.lock_key = l.lock_key
 WHERE coalesce(h.lock_name, k.lock_name) IS NOT NULL
    OR a.application_name LIKE 'pglock %%'
    OR a.application_name LIKE 'celery-pglock%%'
UNION ALL
-- the locks held on rows (the rows lock backend): no session, the row is the holder
SELECT r.lock_key, true, NULL, r.lock_name, NULL, NULL, NULL, NULL, NULL, NULL, true,
       r.task_id, r.host, r.pid, r.slot, r.token, r.since, r.concurrency, r.expires_at
  FROM {row_locks} r
 WHERE r.expires_at > now()
 ORDER BY lock_name, lock_key, granted DESC, query_start;

-- name: ops_running
-- Ledger rows in state `running`, and whether the backend that claimed them still holds
-- the lock (false: the worker died and the row waits for a retry or redelivery).
SELECT r.lock_name, r.slot, r.lock_key, r.state, r.attempts, r.token, r.task_id, r.task_name,
       r.host, r.pid, r.backend_pid, r.entry, r.started_at,
       extract(epoch FROM now() - r.started_at)::float8 AS running_seconds,
       {run_alive}(r.backend_pid, r.lock_key, r.token) AS holder_alive
  FROM {runs} r
 WHERE r.state = 'running'
 ORDER BY r.started_at
 LIMIT %(limit)s;

-- name: ops_recent_skips
SELECT id, at, lock_name, slot, reason, task_id, task_name, host, pid, holder_task_id
  FROM {skips}
 ORDER BY at DESC, id DESC
 LIMIT %(limit)s;

-- name: ops_runs
-- Ledger history, newest first. A NULL filter matches everything; `task` is a LIKE
-- pattern matched against the task name and the lock name. Skips are counted per
-- (lock name, slot) from the skip log, by reason.
SELECT r.lock_name, r.slot, r.state, r.attempts, r.token, r.task_name, r.task_id, r.host,
       r.pid, r.entry, r.sent_by, r.reason, r.scheduled_at, r.started_at, r.finished_at,
       r.updated_at,
       extract(epoch FROM coalesce(r.finished_at, CASE WHEN r.state = 'running' THEN now() END)
                          - r.started_at)::float8 AS duration_seconds,
       coalesce(s.skips, 0) AS skips,
       coalesce(s.reasons, '{{}}'::jsonb) AS skip_reasons
  FROM {runs} r
  LEFT JOIN LATERAL (
        SELECT sum(g.n)::integer AS skips, jsonb_object_agg(g.reason, g.n) AS reasons
          FROM (SELECT k.reason, count(*) AS n FROM {skips} k
                 WHERE k.lock_name = r.lock_name AND k.slot = r.slot
                 GROUP BY k.reason) g
  ) s ON true
 WHERE (%(task)s::text IS NULL OR r.task_name LIKE %(task)s OR r.lock_name LIKE %(task)s)
   AND (%(state)s::text IS NULL OR r.state = %(state)s)
   AND (%(since)s::timestamptz IS NULL OR r.updated_at >= %(since)s)
 ORDER BY coalesce(r.started_at, r.scheduled_at, r.created_at) DESC, r.lock_name, r.slot
 LIMIT %(limit)s;

-- name: ops_lock_keys
-- The keys of one lock name: its own, and under pglock_concurrency the others its holder
-- rows name (a transaction-scope holder's row may not be committed: its own key is
-- passed in, and each of N keys held shows once it has been held in session scope).
SELECT lock_key FROM {holders} WHERE lock_name = %(name)s
UNION
SELECT lock_key FROM {row_locks} WHERE lock_name = %(name)s;

-- name: ops_lock_holders
-- The sessions that hold one lock now (normally one; up to N under pglock_concurrency),
-- with the holder row if recorded.
WITH held AS (
    SELECT l.pid, (l.classid::bigint << 32) | l.objid::bigint AS lock_key
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (%(keys)s::bigint[])
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
       AND l.pid <> pg_backend_pid()
)
SELECT l.pid AS backend_pid, a.application_name, host(a.client_addr) AS client_addr,
       a.usename, a.backend_start, a.xact_start,
       (h.backend_pid = l.pid AND h.since >= a.backend_start
        AND NOT (a.backend_xid IS NOT NULL AND h.since < a.xact_start)) AS recorded,
       h.task_id, h.host, h.pid, h.slot, h.token, h.since,
       -- a session a threads/gevent worker's runs share holds their other locks too
       (SELECT count(*) - 1 FROM pg_locks o
         WHERE o.locktype = 'advisory' AND o.objsubid = 1 AND o.granted
           AND o.pid = l.pid) AS other_locks,
       l.lock_key, NULL::timestamptz AS expires_at
  FROM held l
  JOIN pg_stat_activity a ON a.pid = l.pid
  LEFT JOIN {holders} h ON h.lock_key = l.lock_key
UNION ALL
-- the holders on rows (the rows lock backend)
SELECT NULL, NULL, NULL, NULL, NULL, NULL, true, r.task_id, r.host, r.pid, r.slot, r.token,
       r.since, 0, r.lock_key, r.expires_at
  FROM {row_locks} r
 WHERE r.lock_key = ANY (%(keys)s::bigint[]) AND r.expires_at > now()
 ORDER BY lock_key;

-- name: ops_release_rows
-- Free the locks held on rows by the holders in `tokens` (a holder that finished
-- meanwhile, or was taken over, is left alone): the holder learns at its next renewal.
DELETE FROM {row_locks}
 WHERE lock_key = ANY (%(keys)s::bigint[]) AND token = ANY (%(tokens)s::bigint[])
RETURNING token;

-- name: ops_terminate
-- End the sessions in `pids` that still hold the lock (a holder that finished meanwhile,
-- or a backend pid reused since we looked, is left alone).
SELECT DISTINCT l.pid AS backend_pid, pg_terminate_backend(l.pid) AS terminated
  FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
   AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (%(keys)s::bigint[])
   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
   AND l.pid = ANY(%(pids)s::integer[]);

-- name: ops_still_held
SELECT count(*) AS held FROM pg_locks l
 WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
   AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (%(keys)s::bigint[])
   AND l.pid = ANY(%(pids)s::integer[]);

-- name: prune_skips
-- One batch of skip-log rows older than the cutoff, of one app when %(prefix)s (the
-- LIKE pattern of its lock names, "<namespace>:" and anything) is not NULL.
DELETE FROM {skips}
 WHERE id IN (SELECT id FROM {skips}
               WHERE at < now() - make_interval(secs => %(seconds)s)
                 AND (%(prefix)s::text IS NULL OR lock_name LIKE %(prefix)s::text)
               ORDER BY at
               LIMIT %(batch)s
                 FOR UPDATE SKIP LOCKED);

-- name: prune_runs
-- One batch of ledger rows untouched for longer than the cutoff. A `running` row whose
-- backend still holds the lock is a long job, not an orphan: it is kept. Rows another
-- transaction has locked (a claim in progress) are skipped, never waited for.
DELETE FROM {runs} AS r
 USING (SELECT o.lock_name, o.slot FROM {runs} o
         WHERE o.updated_at < now() - make_interval(secs => %(seconds)s)
           AND (%(prefix)s::text IS NULL OR o.lock_name LIKE %(prefix)s::text)
           AND NOT (o.state = 'running' AND {run_alive}(o.backend_pid, o.lock_key, o.token))
         LIMIT %(batch)s
           FOR UPDATE OF o SKIP LOCKED) AS old
 WHERE r.lock_name = old.lock_name AND r.slot = old.slot;

-- name: prune_beat_sends
-- One batch of beat send claims older than the cutoff (beat only claims slots younger
-- than its grace period, seconds, so an old claim is never needed again).
DELETE FROM {beat_sends} AS b
 USING (SELECT namespace, entry, slot FROM {beat_sends}
         WHERE claimed_at < now() - make_interval(secs => %(seconds)s)
           AND (%(namespace)s::text IS NULL OR namespace = %(namespace)s::text)
         LIMIT %(batch)s
           FOR UPDATE SKIP LOCKED) AS old
 WHERE b.namespace = old.namespace AND b.entry = old.entry AND b.slot = old.slot;

-- name: prune_holders
-- One batch of holder rows older than the cutoff whose session no longer holds the lock.
-- There is one row per lock key ever held, so per-argument keys would pile them up; a
-- live holder's row is kept however old.
DELETE FROM {holders} AS h
 USING (SELECT o.lock_key FROM {holders} o
         WHERE o.since < now() - make_interval(secs => %(seconds)s)
           AND (%(prefix)s::text IS NULL OR o.lock_name LIKE %(prefix)s::text)
           AND NOT {holds_lock}(o.backend_pid, o.lock_key)
         LIMIT %(batch)s
           FOR UPDATE OF o SKIP LOCKED) AS old
 WHERE h.lock_key = old.lock_key;

-- name: ops_rogue_sends
SELECT task_name, origin, first_at, last_at, reports FROM {rogue_sends}
 WHERE namespace = %(namespace)s AND last_at > now() - interval '1 day'
 ORDER BY last_at DESC;
