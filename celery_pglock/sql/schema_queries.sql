-- Named statements of the migrations (migrations.py; see queries.sql for the conventions).

-- name: schema_exists
-- By exact name: to_regnamespace() would parse (and case-fold) the name as SQL syntax.
SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %(schema)s);

-- name: version_table_exists
SELECT to_regclass(%(table)s) IS NOT NULL;

-- name: current_version
SELECT max(version) FROM {schema_version};

-- name: migration_lock
-- One migrating process at a time (a transaction-level lock: the commit frees it).
SELECT pg_advisory_xact_lock(%(key)s);

-- name: read_committed
-- Whatever default_transaction_isolation says: a waiter must see the winner's rows.
SET TRANSACTION ISOLATION LEVEL READ COMMITTED;

-- name: create_schema
CREATE SCHEMA IF NOT EXISTS {schema};

-- name: create_version_table
CREATE TABLE IF NOT EXISTS {schema_version} (
    version    integer     PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: record_version
INSERT INTO {schema_version} (version) VALUES (%(version)s) ON CONFLICT DO NOTHING;

-- name: record_version_in_script
-- The same in the script `celery pglock migrate --sql` prints for a DBA: the version as a
-- literal (psycopg.sql.Literal), since a script has no parameters.
INSERT INTO {schema_version} (version) VALUES ({version}) ON CONFLICT DO NOTHING;

-- name: ping
-- One round trip: is the session (and so its advisory locks) still there?
SELECT 1;
