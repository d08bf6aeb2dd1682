-- celery-pglock schema, version 1: the run ledger, fencing tokens, holders and skips.
-- Placeholders in braces are identifiers filled in (quoted) from pglock_schema and
-- pglock_table_prefix; `celery pglock migrate --sql` prints this with them filled in.

-- One row per (lock name, slot): the durable identity of one run.
CREATE TABLE IF NOT EXISTS {runs} (
    lock_name    text        NOT NULL,
    slot         text        NOT NULL,
    lock_key     bigint      NOT NULL,
    state        text        NOT NULL
        CHECK (state IN ('scheduled', 'running', 'succeeded', 'failed')),
    attempts     integer     NOT NULL DEFAULT 0,
    token        bigint,
    task_id      text,
    task_name    text,
    host         text,
    pid          integer,
    backend_pid  integer,
    entry        text,
    sent_by      text,
    reason       text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    scheduled_at timestamptz,
    started_at   timestamptz,
    finished_at  timestamptz,
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (lock_name, slot)
);
CREATE INDEX IF NOT EXISTS {runs_updated_idx} ON {runs} (updated_at);

-- Fencing tokens: one sequence, so every granted attempt gets a larger number.
CREATE SEQUENCE IF NOT EXISTS {tokens};

-- The highest token that wrote to each protected resource (see fence()).
CREATE TABLE IF NOT EXISTS {fences} (
    resource   text        PRIMARY KEY,
    token      bigint      NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- Who took each session-scope lock. Only rows whose backend still holds the advisory
-- lock (pg_locks) describe a live holder; older rows are overwritten on the next grant.
-- UNLOGGED: a row lives no longer than the lock it describes, which a server crash or a
-- failover ends anyway; unlogged, the write in `acquire` needs no WAL flush, so a lock
-- without a slot commits without waiting for the disk.
CREATE UNLOGGED TABLE IF NOT EXISTS {holders} (
    lock_key    bigint      PRIMARY KEY,
    lock_name   text        NOT NULL,
    slot        text,
    task_id     text,
    host        text,
    pid         integer,
    backend_pid integer     NOT NULL,
    token       bigint,
    since       timestamptz NOT NULL DEFAULT now()
);

-- Every skipped message, append-only: why, and who held the lock or ran the slot.
-- Appending never waits on a row another transaction holds, so a skip is decided at
-- once even while a transaction-scope holder has the ledger row locked.
CREATE TABLE IF NOT EXISTS {skips} (
    id             bigserial   PRIMARY KEY,
    lock_name      text        NOT NULL,
    slot           text,
    reason         text        NOT NULL,
    task_id        text,
    task_name      text,
    host           text,
    pid            integer,
    holder_task_id text,
    at             timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {skips_run_idx} ON {skips} (lock_name, slot);
CREATE INDEX IF NOT EXISTS {skips_at_idx} ON {skips} (at);

-- Beat: the schedule state of each entry (what PersistentScheduler keeps in a shelve file).
CREATE TABLE IF NOT EXISTS {beat} (
    namespace       text        NOT NULL,
    entry           text        NOT NULL,
    last_slot       text,
    last_run_at     timestamptz,
    total_run_count integer     NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, entry)
);

-- Beat: one row per (entry, slot) sent. Only the replica whose INSERT created the row
-- publishes; sent_at stays NULL until the broker took the message, so a claim whose
-- sender died before publishing is found and re-sent.
CREATE TABLE IF NOT EXISTS {beat_sends} (
    namespace  text        NOT NULL,
    entry      text        NOT NULL,
    slot       text        NOT NULL,
    lock_name  text,
    sent_by    text        NOT NULL,
    sends      integer     NOT NULL DEFAULT 1,
    claimed_at timestamptz NOT NULL DEFAULT now(),
    sent_at    timestamptz,
    PRIMARY KEY (namespace, entry, slot)
);
CREATE INDEX IF NOT EXISTS {beat_sends_unsent_idx} ON {beat_sends} (claimed_at)
    WHERE sent_at IS NULL;
CREATE INDEX IF NOT EXISTS {beat_sends_claimed_idx} ON {beat_sends} (claimed_at);
