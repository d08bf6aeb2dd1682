-- celery-pglock schema, version 9: what every lock statement shares, written once as
-- functions: take the lock with its token, lease, label and holder row (`grant_lock`),
-- arm or disarm the server-enforced lease (`set_lease`), label the session
-- (`label_session`). `xact` picks transaction scope (the lock and the lease end with the
-- transaction) over session scope.

-- The lease: the server ends this session (session scope) or its idle transaction
-- (transaction scope) after `ms` idle milliseconds; the session's configured value puts
-- it back. NULL leaves it as it is: no lease, or a server older than 14, which has no
-- idle_session_timeout (the CASE never reaches its set_config there). A one-expression SQL
-- function: PostgreSQL inlines it into the statement that calls it.
CREATE OR REPLACE FUNCTION {set_lease}(ms text, xact boolean)
RETURNS text LANGUAGE sql VOLATILE AS $$
    SELECT CASE WHEN ms IS NULL THEN NULL
                WHEN xact THEN set_config('idle_in_transaction_session_timeout', ms, true)
                ELSE set_config('idle_session_timeout', ms, false) END
$$;

-- What pg_stat_activity shows for this session: who holds a lock (`celery pglock status`
-- reads it), a beat replica's role, or the pooled name between runs.
CREATE OR REPLACE FUNCTION {label_session}(name text)
RETURNS text LANGUAGE sql VOLATILE AS $$
    SELECT set_config('application_name', name, false)
$$;

-- Try the lock, now, without waiting: the claim's one key, or under pglock_concurrency the
-- first free one of its N keys (`try_lock_any`, after the slot's own key). Granted: a
-- fencing token, the lease armed, the session labelled with its holder (`label`), the
-- holder recorded. `key` says which key was taken; NULL when none was.
CREATE OR REPLACE FUNCTION {grant_lock}(
    lock_keys bigint[], slot_lock integer[], xact boolean, lease_ms text, label text,
    holder_lock_name text, holder_slot text, holder_task_id text, holder_host text,
    holder_pid integer, holder_concurrency integer,
    OUT acquired boolean, OUT key bigint, OUT token bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    got boolean;
    armed text;
BEGIN
    IF cardinality(lock_keys) > 1 THEN
        key := {try_lock_any}(lock_keys, slot_lock, xact);
    ELSE
        -- (plpgsql's IF reads its condition up to the first THEN: no CASE inside one)
        got := CASE WHEN xact THEN pg_try_advisory_xact_lock(lock_keys[1])
                    ELSE pg_try_advisory_lock(lock_keys[1]) END;
        key := CASE WHEN got THEN lock_keys[1] END;
    END IF;
    acquired := key IS NOT NULL;
    IF acquired THEN
        -- Labelled at once: a message skipped meanwhile names this holder from the label
        -- before the holder row below is committed.
        armed := {label_session}(label);
        -- One statement: each one a function runs costs it a round of the executor.
        INSERT INTO {holders} AS h (lock_key, lock_name, slot, task_id, host, pid, backend_pid,
                                    token, concurrency)
        VALUES (key, holder_lock_name, holder_slot, holder_task_id, holder_host, holder_pid,
                pg_backend_pid(), {next_token}(), holder_concurrency)
        ON CONFLICT (lock_key) DO UPDATE
            SET lock_name = EXCLUDED.lock_name, slot = EXCLUDED.slot,
                task_id = EXCLUDED.task_id, host = EXCLUDED.host, pid = EXCLUDED.pid,
                backend_pid = EXCLUDED.backend_pid, token = EXCLUDED.token, since = now(),
                concurrency = EXCLUDED.concurrency
        RETURNING h.token, {set_lease}(lease_ms, xact) INTO token, armed;
    END IF;
END
$$;
