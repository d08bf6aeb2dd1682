-- celery-pglock schema, version 10: what the dashboard reads, by index. An entry's newest
-- slots and its history over a window come from its runs (its lock name's, naming the
-- entry or none) in the order they were created (slots are not all times: `manual:…`
-- and a caller's own names sort apart),
-- its skips over a window from the skip log by lock name and time, the audit trail of a
-- namespace newest first.
CREATE INDEX IF NOT EXISTS {runs_lock_created_idx} ON {runs} (lock_name, entry, created_at);
CREATE INDEX IF NOT EXISTS {skips_lock_at_idx} ON {skips} (lock_name, at);
CREATE INDEX IF NOT EXISTS {audit_namespace_idx} ON {audit} (namespace, id);

-- An entry's rows are its lock name's that name it: the two columns go together (most
-- lock names have one entry). Without this the planner multiplies their selectivities,
-- expects a handful of rows per entry, and reads all of them to sort instead of the
-- newest few by the index.
CREATE STATISTICS IF NOT EXISTS {runs_entry_stats} (dependencies) ON lock_name, entry FROM {runs};
ANALYZE {runs};

-- The skips of one slot, counted by reason (NULL, NULL: none), for the dashboard's rows.
-- A one-SELECT SQL function: PostgreSQL inlines it into the statement that joins it.
CREATE OR REPLACE FUNCTION {skip_counts}(name text, slot_name text)
RETURNS TABLE (skips integer, reasons jsonb) LANGUAGE sql STABLE AS $$
    SELECT sum(g.n)::integer, jsonb_object_agg(g.reason, g.n)
      FROM (SELECT k.reason, count(*) AS n FROM {skips} k
             WHERE k.lock_name = name AND k.slot = slot_name
             GROUP BY k.reason) g
$$;
