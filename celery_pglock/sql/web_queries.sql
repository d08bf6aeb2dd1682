-- Statements of the dashboard (celery_pglock/steering/history.py). Each reads through an
-- index of migration 10, whatever the size of the ledger.

-- name: web_jit_off
-- The dashboard's session: its statements are short, and JIT compiling one costs more
-- than running it.
SET jit = off;

-- name: web_strip
-- The newest `limit` ledger rows of each (lock name, entry), whatever their slot's name
-- (time slots, manual:…, a caller's own), with the skips of each slot by reason. Entries
-- of one task share its lock name: a row is an entry's when it names the entry, or none.
SELECT l.lock_name, l.entry, r.slot, r.state, r.attempts, r.token, r.task_id, r.host, r.pid,
       r.reason, r.sent_by, r.created_at, r.scheduled_at, r.started_at, r.finished_at,
       extract(epoch FROM coalesce(r.finished_at, CASE WHEN r.state = 'running' THEN now() END)
                          - r.started_at)::float8 AS duration_seconds,
       coalesce(s.skips, 0) AS skips,
       s.reasons AS skip_reasons  -- NULL: none
  FROM unnest(%(lock_names)s::text[], %(entries)s::text[]) AS l(lock_name, entry)
 CROSS JOIN LATERAL (
        SELECT * FROM (
            (SELECT * FROM {runs} x
              WHERE x.lock_name = l.lock_name AND x.entry = l.entry
              ORDER BY x.created_at DESC LIMIT %(limit)s)
            UNION ALL
            (SELECT * FROM {runs} x
              WHERE x.lock_name = l.lock_name AND x.entry IS NULL
              ORDER BY x.created_at DESC LIMIT %(limit)s)
        ) u
         ORDER BY u.created_at DESC
         LIMIT %(limit)s
 ) r
  LEFT JOIN LATERAL {skip_counts}(r.lock_name, r.slot) s ON true
 ORDER BY l.entry, r.created_at;

-- name: web_stats
-- Per (lock name, entry), the runs created since `since`: how many, how they ended, and the 50th
-- and 95th percentiles of the succeeded ones' durations (seconds).
SELECT l.entry,
       count(*)::integer AS runs,
       count(*) FILTER (WHERE r.state = 'succeeded')::integer AS succeeded,
       count(*) FILTER (WHERE r.state = 'failed')::integer AS failed,
       percentile_cont(0.5) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.started_at))
           FILTER (WHERE r.state = 'succeeded') AS p50_seconds,
       percentile_cont(0.95) WITHIN GROUP (ORDER BY extract(epoch FROM r.finished_at - r.started_at))
           FILTER (WHERE r.state = 'succeeded') AS p95_seconds
  FROM unnest(%(lock_names)s::text[], %(entries)s::text[]) AS l(lock_name, entry)
  JOIN {runs} r ON r.lock_name = l.lock_name AND r.created_at >= %(since)s
                AND (r.entry = l.entry OR r.entry IS NULL)
 GROUP BY l.entry;

-- name: web_last_success
-- The newest succeeded run of each (lock name, entry).
SELECT l.entry, r.slot, r.finished_at, r.token
  FROM unnest(%(lock_names)s::text[], %(entries)s::text[]) AS l(lock_name, entry)
 CROSS JOIN LATERAL (
        SELECT * FROM (
            (SELECT x.slot, x.finished_at, x.token, x.created_at FROM {runs} x
              WHERE x.lock_name = l.lock_name AND x.entry = l.entry AND x.state = 'succeeded'
              ORDER BY x.created_at DESC LIMIT 1)
            UNION ALL
            (SELECT x.slot, x.finished_at, x.token, x.created_at FROM {runs} x
              WHERE x.lock_name = l.lock_name AND x.entry IS NULL AND x.state = 'succeeded'
              ORDER BY x.created_at DESC LIMIT 1)
        ) u
         ORDER BY u.created_at DESC
         LIMIT 1
 ) r;

-- name: web_entry_runs
-- One entry's ledger rows (its lock name's, naming it or no entry) created in
-- [since, until), newest first, a page of them.
SELECT r.lock_name, r.slot, r.state, r.attempts, r.token, r.task_id, r.task_name, r.host,
       r.pid, r.entry, r.reason, r.sent_by, r.created_at, r.scheduled_at, r.started_at,
       r.finished_at,
       extract(epoch FROM coalesce(r.finished_at, CASE WHEN r.state = 'running' THEN now() END)
                          - r.started_at)::float8 AS duration_seconds,
       coalesce(s.skips, 0) AS skips,
       coalesce(s.reasons, '{{}}'::jsonb) AS skip_reasons
  FROM (
        (SELECT * FROM {runs} x
          WHERE x.lock_name = %(lock_name)s AND x.entry = %(entry)s
            AND x.created_at >= %(since)s AND x.created_at < %(until)s
          ORDER BY x.created_at DESC LIMIT %(limit)s + %(offset)s)
        UNION ALL
        (SELECT * FROM {runs} x
          WHERE x.lock_name = %(lock_name)s AND x.entry IS NULL
            AND x.created_at >= %(since)s AND x.created_at < %(until)s
          ORDER BY x.created_at DESC LIMIT %(limit)s + %(offset)s)
  ) r
  LEFT JOIN LATERAL {skip_counts}(r.lock_name, r.slot) s ON true
 ORDER BY r.created_at DESC, r.slot
 LIMIT %(limit)s OFFSET %(offset)s;

-- name: web_entry_skips
-- One lock name's skips in [since, until), oldest first.
SELECT id, at, slot, reason, task_id, host, pid, holder_task_id
  FROM {skips}
 WHERE lock_name = %(lock_name)s AND at >= %(since)s AND at < %(until)s
 ORDER BY at, id
 LIMIT %(limit)s;

-- name: web_entry_waiting
-- One lock name's slots that wait their turn (pglock_overlap = "buffer_one").
SELECT slot, task_id, waiting_since, sent_at, sends
  FROM {waiting}
 WHERE lock_name = %(lock_name)s
 ORDER BY waiting_since;

-- name: web_audit
-- A namespace's audit trail, newest first; `entry` (NULL: any) narrows it.
SELECT id, at, action, entry, lock_name, slot, actor, reason, detail
  FROM {audit}
 WHERE namespace = %(namespace)s
   AND (%(entry)s::text IS NULL OR entry = %(entry)s OR lock_name = %(lock_name)s)
 ORDER BY id DESC
 LIMIT %(limit)s OFFSET %(offset)s;
