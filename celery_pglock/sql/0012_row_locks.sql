-- celery-pglock schema, version 12: the rows lock backend, for where no server session is
-- ours (a transaction pooler: pglock_lock_backend = "rows", or "auto" once one is found).
-- A lock held on rows is a row of `row_locks` stamped with the server's now() + lease; the
-- holder's heartbeat renews it every third of the lease in a short transaction of its own,
-- and another claimer takes it over only once it expired. Every statement is one
-- transaction, so any pooler passes it. The two backends exclude each other on the same
-- key: a grant on rows holds the key's advisory lock for its own transaction (so no
-- session holds it meanwhile), and a grant on an advisory lock gives the key back when an
-- unexpired row holds it.
--
-- Logged, unlike `holders`: the row IS the lock here, and must outlive a restart and
-- reach a synchronous standby. The beat leader's lock lives here too (its term is the
-- row's token), as does every run's under `pglock_concurrency` (one row per key).
CREATE TABLE IF NOT EXISTS {row_locks} (
    lock_key    bigint      PRIMARY KEY,
    lock_name   text        NOT NULL,
    slot        text,
    task_id     text,
    host        text,
    pid         integer,
    token       bigint      NOT NULL,
    concurrency integer     NOT NULL DEFAULT 1,
    since       timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);

-- Whether an unexpired row holds `lock_key` (for any token).
CREATE OR REPLACE FUNCTION {row_held}(lock_key bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (SELECT 1 FROM {row_locks} h
                    WHERE h.lock_key = $1 AND h.expires_at > now())
$$;

-- Whether the attempt of a `running` ledger row lives on: on rows (backend_pid NULL) its
-- token's row is unexpired; on an advisory lock its backend still holds the lock.
CREATE OR REPLACE FUNCTION {run_alive}(backend_pid integer, lock_key bigint, token bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN $1 IS NULL
                THEN EXISTS (SELECT 1 FROM {row_locks} h
                              WHERE h.lock_key = $2 AND h.token = $3
                                AND h.expires_at > now())
                ELSE {holds_lock}($1, $2) END
$$;

-- Whether beat replica of term `term` still leads (its leader lock on rows, key
-- `lock_key`, unexpired): a leader's claims are fenced by it. `lock_key` NULL: no fence (a
-- leader on an advisory lock claims on its own session; active-active replicas all claim).
CREATE OR REPLACE FUNCTION {leads}(lock_key bigint, term bigint)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT $1 IS NULL OR {run_alive}(NULL, $1, $2)
$$;

-- Take the lock on rows, now, without waiting: the claim's one key, or under
-- pglock_concurrency the first free one of its N keys. A key is free when no session holds
-- its advisory lock and no unexpired row holds it; its advisory lock, taken for this
-- transaction, keeps it so until the caller's statement commits its row (`hold_row_lock`).
-- With a slot under pglock_concurrency (`slot_lock`) the slot must not be running already
-- under another key. Each check is a statement of its own, so it sees what committed
-- since the caller's statement began. `key` NULL: none was free.
CREATE OR REPLACE FUNCTION {grant_row_lock}(
    lock_keys bigint[], slot_lock integer[], holder_lock_name text, holder_slot text,
    OUT acquired boolean, OUT key bigint, OUT token bigint)
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    candidate bigint;
    got boolean;
BEGIN
    acquired := false;
    IF slot_lock IS NOT NULL THEN
        got := pg_try_advisory_xact_lock(slot_lock[1], slot_lock[2]);
        IF NOT got THEN
            RETURN;
        END IF;
        IF EXISTS (SELECT 1 FROM {runs} r
                    WHERE r.lock_name = holder_lock_name AND r.slot = holder_slot
                      AND r.state = 'running'
                      AND {run_alive}(r.backend_pid, r.lock_key, r.token)) THEN
            RETURN;
        END IF;
    END IF;
    FOREACH candidate IN ARRAY lock_keys LOOP
        -- Apart from the check below: its snapshot must come after the lock is ours.
        got := pg_try_advisory_xact_lock(candidate);
        IF got AND NOT {row_held}(candidate) THEN
            key := candidate;
            acquired := true;
            token := {next_token}();
            RETURN;
        END IF;
    END LOOP;
END
$$;

-- The holder's renewal: the row's expiry pushed to now + `lease_s` while the row is still
-- `held_token`'s and unexpired; NULL once it is not (the lock is lost). It waits for the key's
-- advisory lock first, which a claimer on rows holds from its check to its commit: so a
-- renewal and a takeover never interleave (a renewal begun just before the expiry could
-- otherwise commit after a claimer saw the row expired, and both would hold the key).
-- clock_timestamp(), not now(): the expiry is judged after that wait.
CREATE OR REPLACE FUNCTION {renew_row_lock}(held_key bigint, held_token bigint, lease_s float8)
RETURNS timestamptz LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    renewed timestamptz;
BEGIN
    PERFORM set_config('lock_timeout', '1000', true);  -- a claim's transaction is short
    PERFORM pg_advisory_xact_lock(held_key);
    UPDATE {row_locks} h
       SET expires_at = clock_timestamp() + make_interval(secs => lease_s)
     WHERE h.lock_key = held_key AND h.token = held_token
       AND h.expires_at > clock_timestamp()
    RETURNING h.expires_at INTO renewed;
    RETURN renewed;
END
$$;

-- A key of `grant_lock` (a session's advisory lock) that an unexpired row holds is not
-- the caller's: given back (session scope; transaction scope frees it at its end).
CREATE OR REPLACE FUNCTION {advisory_free}(lock_key bigint, xact boolean)
RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF NOT {row_held}(lock_key) THEN
        RETURN true;
    END IF;
    IF NOT xact THEN
        PERFORM pg_advisory_unlock(lock_key);
    END IF;
    RETURN false;
END
$$;

-- As in version 8, and a key held on rows is not free.
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
        IF got AND {advisory_free}(candidate, xact) THEN
            RETURN candidate;
        END IF;
    END LOOP;
    IF slot_lock IS NOT NULL AND NOT xact THEN  -- not left held by a pooled session
        PERFORM pg_advisory_unlock(slot_lock[1], slot_lock[2]);
    END IF;
    RETURN NULL;
END
$$;

-- As in version 9, and a key held on rows is not granted.
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
        key := CASE WHEN got AND {advisory_free}(lock_keys[1], xact) THEN lock_keys[1] END;
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

-- As in version 8, and a key held on rows is held.
CREATE OR REPLACE FUNCTION {any_held}(lock_keys bigint[])
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_locks l
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND ((l.classid::bigint << 32) | l.objid::bigint) = ANY (lock_keys))
        OR EXISTS (SELECT 1 FROM {row_locks} h
                    WHERE h.lock_key = ANY (lock_keys) AND h.expires_at > now())
$$;
