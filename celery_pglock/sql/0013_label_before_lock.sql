-- celery-pglock schema, version 13: a holder's session is labelled before it takes the
-- lock. `grant_lock` labelled it ("pglock <pid> <task id> <host>", application_name)
-- once the lock was granted, after its look at `row_locks` (version 12); a message
-- refused in between found the lock held by an unlabelled session whose holder row was
-- not committed yet, and its SKIPPED result named no holder (seen in make test). Now the
-- label comes first, and is put back when the lock is not granted. Otherwise as in
-- version 12, whose body this replaces whole.
CREATE OR REPLACE FUNCTION {grant_lock}(
    lock_keys bigint[], slot_lock integer[], xact boolean, lease_ms text, label text,
    holder_lock_name text, holder_slot text, holder_task_id text, holder_host text,
    holder_pid integer, holder_concurrency integer,
    OUT acquired boolean, OUT key bigint, OUT token bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    got boolean;
    armed text;
    idle_label text := current_setting('application_name');
BEGIN
    armed := {label_session}(label);
    IF cardinality(lock_keys) > 1 THEN
        key := {try_lock_any}(lock_keys, slot_lock, xact);
    ELSE
        -- (plpgsql's IF reads its condition up to the first THEN: no CASE inside one)
        got := CASE WHEN xact THEN pg_try_advisory_xact_lock(lock_keys[1])
                    ELSE pg_try_advisory_lock(lock_keys[1]) END;
        key := CASE WHEN got AND {advisory_free}(lock_keys[1], xact) THEN lock_keys[1] END;
    END IF;
    acquired := key IS NOT NULL;
    IF NOT acquired THEN
        armed := {label_session}(idle_label);
        RETURN;
    END IF;
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
END
$$;
