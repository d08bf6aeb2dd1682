-- celery-pglock schema, version 8: the run policies. `pglock_concurrency = N` runs up to N
-- slots of one lock name at once, each under one of N advisory keys (the lock's own key
-- and N - 1 derived ones); `try_lock_any` takes the first free one. `pglock_overlap =
-- "buffer_one"` keeps one slot waiting per lock name while the lock is held: its message
-- is kept in `waiting` (not in a worker), its ledger row is `waiting`, and the holder that
-- frees the lock sends it; the beat leader sends one whose holder died.
-- The first free one of `lock_keys`, or NULL. With a slot (`slot_lock`, the slot's own
-- two-int advisory key: objsubid 2, apart from every lock name's bigint key) it first takes
-- that, so that one slot never runs twice at once under two of the keys. A claim that gets
-- no key gives the slot's key back (in transaction scope its transaction's end does); one
-- that gets a key keeps both until it frees them all (unlock_all, or the commit).
CREATE OR REPLACE FUNCTION {try_lock_any}(lock_keys bigint[], slot_lock integer[], xact boolean)
RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    candidate bigint;
    got boolean;
BEGIN
    -- (plpgsql's IF reads its condition up to the first THEN: no CASE inside one)
    IF slot_lock IS NOT NULL THEN
        got := CASE WHEN xact THEN pg_try_advisory_xact_lock(slot_lock[1], slot_lock[2])
                    ELSE pg_try_advisory_lock(slot_lock[1], slot_lock[2]) END;
        IF NOT got THEN
            RETURN NULL;
        END IF;
    END IF;
    FOREACH candidate IN ARRAY lock_keys LOOP
        got := CASE WHEN xact THEN pg_try_advisory_xact_lock(candidate)
                    ELSE pg_try_advisory_lock(candidate) END;
        IF got THEN
            RETURN candidate;
        END IF;
    END LOOP;
    IF slot_lock IS NOT NULL AND NOT xact THEN  -- not left held by a pooled session
        PERFORM pg_advisory_unlock(slot_lock[1], slot_lock[2]);
    END IF;
    RETURN NULL;
END
$$;

-- Whether any backend holds one of `lock_keys` (a lock name's N keys).
CREATE OR REPLACE FUNCTION {any_held}(lock_keys bigint[])
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (lock_keys))
$$;

-- How many concurrent runs the holder's lock name allows (status shows "2 of 3 held").
ALTER TABLE {holders} ADD COLUMN IF NOT EXISTS concurrency integer NOT NULL DEFAULT 1;

ALTER TABLE {runs} DROP CONSTRAINT IF EXISTS {runs_state_check};
ALTER TABLE {runs} ADD CONSTRAINT {runs_state_check}
    CHECK (state IN ('scheduled', 'running', 'succeeded', 'failed', 'skipped', 'paused',
                     'waiting'));

-- The one waiting slot of a lock name, with the message that runs it: the task's arguments
-- as its serializer encoded them, the headers that name the slot, and where to send it.
-- sent_at: when a holder (or the beat leader) last sent it; NULL while it waits.
CREATE TABLE IF NOT EXISTS {waiting} (
    lock_name        text        PRIMARY KEY,
    lock_keys        bigint[]    NOT NULL,
    slot             text        NOT NULL,
    task_id          text        NOT NULL,
    task_name        text        NOT NULL,
    entry            text,
    body             bytea       NOT NULL,
    content_type     text        NOT NULL,
    content_encoding text        NOT NULL,
    headers          jsonb       NOT NULL,
    exchange         text,
    routing_key      text,
    waiting_since    timestamptz NOT NULL DEFAULT now(),
    sent_at          timestamptz,
    sends            integer     NOT NULL DEFAULT 0
);
