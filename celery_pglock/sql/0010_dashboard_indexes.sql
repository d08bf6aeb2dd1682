-- celery-pglock schema, version 10: what the dashboard reads, by index. An entry's newest
-- slots and its history over a window come from its lock name's runs in the order they
-- were created (slots are not all times: `manual:…` and a caller's own names sort apart),
-- its skips over a window from the skip log by lock name and time, the audit trail of a
-- namespace newest first.
CREATE INDEX IF NOT EXISTS {runs_lock_created_idx} ON {runs} (lock_name, created_at);
CREATE INDEX IF NOT EXISTS {skips_lock_at_idx} ON {skips} (lock_name, at);
CREATE INDEX IF NOT EXISTS {audit_namespace_idx} ON {audit} (namespace, id);
