-- celery-pglock schema, version 4: one definition of "the backend a row names still holds
-- the row's advisory lock", for the statements that judge whether a row's holder lives on
-- (the beat leader's sweep of orphaned `running` rows, the pruning of old holder rows).
-- pg_locks shows a bigint advisory key as (classid, objid) = (high, low) 32 bits, objsubid 1.
CREATE OR REPLACE FUNCTION {holds_lock}(backend_pid integer, lock_key bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND l.pid = backend_pid
           AND l.classid = ((lock_key >> 32) & 4294967295)::oid
           AND l.objid = (lock_key & 4294967295)::oid)
$$;
