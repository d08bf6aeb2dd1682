-- celery-pglock schema, version 5: fencing tokens that never go back across a failover.
-- A replica promoted after asynchronous replication stopped short has a token sequence
-- behind the old primary's, by every value that was not shipped. Each promotion starts a
-- new timeline, numbered above every earlier one; so a token is never lower than
-- (timeline - 1) * 2^40, and the first token on a new timeline jumps past all that an
-- earlier timeline could issue (2^40: a trillion tokens each). On timeline 1 nothing
-- changes. The jump is made in the sequence itself (setval) rather than added to each
-- token, so that it survives what starts timeline 1 again: pg_upgrade, dump and restore.
CREATE OR REPLACE FUNCTION {next_token}() RETURNS bigint LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    -- First: on a standby nextval raises the read-only error that we translate.
    token bigint := nextval({tokens_regclass});
    -- The timeline of the WAL being written now, from its file name's first 8 hex digits
    -- (pg_control_checkpoint() learns a new timeline only at the next checkpoint).
    timeline bigint := ('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::bigint;
    lowest bigint := (timeline - 1) << 40;
BEGIN
    IF token > lowest THEN
        RETURN token;
    END IF;
    -- Among the first tokens of a new timeline: one session raises the sequence while the
    -- others wait, then draw above it (two racing setvals could hand one value out twice).
    -- The two-key form: a lock space of its own, apart from the locks of tasks.
    PERFORM pg_advisory_xact_lock(1885826155, hashtext({tokens_regclass}));
    token := nextval({tokens_regclass});
    IF token <= lowest THEN
        PERFORM setval({tokens_regclass}, lowest);
        token := nextval({tokens_regclass});
    END IF;
    RETURN token;
END
$$;
