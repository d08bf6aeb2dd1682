-- Named statements of a connection's own upkeep (sessions.py, db.py; see queries.sql for
-- the conventions). None names a table: they run before the schema is known.

-- name: show_setting
SELECT current_setting(%(name)s);

-- name: watch_client
-- A backend blocked in a lock queue (advisory_lock(wait=True), a beat standby) does not
-- notice that its client died until it is granted, and would then hold the lock for
-- nobody: PostgreSQL >= 14 looks this often (ms) while a statement runs.
SELECT set_config('client_connection_check_interval', %(ms)s, false);

-- name: backend_pid
SELECT pg_backend_pid();

-- name: reset_connection
-- A pooled connection given back on an error path: free its locks, put its lease back to
-- the role's and database's own (a DBA may set them), and its application_name to the
-- pooled one, not a holder's ("pglock <pid> <task>") that a skipped slot's grant set.
SELECT pg_advisory_unlock_all();
SET idle_in_transaction_session_timeout = DEFAULT;
SET idle_session_timeout = DEFAULT;
RESET application_name;

-- name: reset_connection_pre14
-- The same before PostgreSQL 14, which has no idle_session_timeout.
SELECT pg_advisory_unlock_all();
SET idle_in_transaction_session_timeout = DEFAULT;
RESET application_name;

-- name: free_connection_slots
-- Connection slots of the server a client without a reserved role can still take: those
-- left once the reserved ones (superusers', PostgreSQL 16's reserved_connections) are set
-- aside. pg_stat_activity lists every backend to any role; only client backends count.
-- Then the client port the server sees (NULL over a Unix socket): another one than the
-- library's own socket means a pooler or proxy stands between them.
SELECT current_setting('max_connections')::int
     - current_setting('superuser_reserved_connections')::int
     - coalesce(nullif(current_setting('reserved_connections', true), '')::int, 0)
     - (SELECT count(*)::int FROM pg_stat_activity WHERE backend_type = 'client backend'),
       inet_client_port();
