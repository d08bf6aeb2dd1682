-- Schedule entries stored in PostgreSQL (migration 0011): written by
-- `celery_pglock.schedules` (the CLI's `entries` and the dashboard call it), read by beat.
-- A change runs in one transaction: `entry_next_version` first (it locks the namespace's
-- row: changes of one namespace take turns), then the entry's row, then its audit row.

-- name: entry_next_version
INSERT INTO {entry_versions} AS v (namespace, version)
VALUES (%(namespace)s, 1)
ON CONFLICT (namespace) DO UPDATE SET version = v.version + 1
RETURNING version;

-- name: entry_version
-- The namespace's newest change number (none yet: no row): beat's check, once per tick.
SELECT version FROM {entry_versions} WHERE namespace = %(namespace)s;

-- name: entry_get
SELECT * FROM {entries} WHERE namespace = %(namespace)s AND name = %(name)s AND NOT removed;

-- name: entry_list
SELECT * FROM {entries} WHERE namespace = %(namespace)s AND NOT removed ORDER BY name;

-- name: entry_changes
-- Every row changed after change number %(since)s, removals included, oldest first. The
-- JSON columns come packed in one JSON array (`packed`, as JSON_COLUMNS lists them), as
-- text: one parse a row, not five (a new leader reads 100,000 rows at once).
SELECT name, task, starts_at, ends_at, enabled, version, changed_by, changed_at, removed,
       json_build_array(schedule, args, kwargs, options, pglock)::text AS packed
  FROM {entries} WHERE namespace = %(namespace)s AND version > %(since)s
 ORDER BY version;

-- name: entry_write
-- Add or replace an entry (a removed one comes back), at change number %(version)s; the
-- JSON columns come as JSON text.
INSERT INTO {entries} AS e (namespace, name, task, schedule, args, kwargs, options, pglock,
                            starts_at, ends_at, enabled, removed, version, changed_by)
VALUES (%(namespace)s, %(name)s, %(task)s, %(schedule)s::jsonb, %(args)s::jsonb,
        %(kwargs)s::jsonb, %(options)s::jsonb, %(pglock)s::jsonb, %(starts_at)s, %(ends_at)s,
        %(enabled)s, false, %(version)s, %(changed_by)s)
ON CONFLICT (namespace, name) DO UPDATE
   SET task = EXCLUDED.task, schedule = EXCLUDED.schedule, args = EXCLUDED.args,
       kwargs = EXCLUDED.kwargs, options = EXCLUDED.options, pglock = EXCLUDED.pglock,
       starts_at = EXCLUDED.starts_at, ends_at = EXCLUDED.ends_at,
       enabled = EXCLUDED.enabled, removed = false, version = EXCLUDED.version,
       changed_by = EXCLUDED.changed_by, changed_at = now()
RETURNING *;

-- name: entry_remove
-- Remove an entry, kept as a tombstone so that beat replicas learn of it.
UPDATE {entries}
   SET removed = true, version = %(version)s, changed_by = %(changed_by)s, changed_at = now()
 WHERE namespace = %(namespace)s AND name = %(name)s AND NOT removed
RETURNING *;
