-- celery-pglock schema, version 2: finding `running` rows without reading the ledger.
-- The beat leader looks for rows a dead attempt left `running` every few seconds
-- (`abandon_orphans`), and `celery pglock status` lists running rows: both read this
-- partial index, which holds only the few rows that are running at any moment.

CREATE INDEX IF NOT EXISTS {runs_running_idx} ON {runs} (started_at) WHERE state = 'running';
