-- celery-pglock schema, version 6: what an operator steers, kept where every beat replica
-- reads it. A paused entry (`pauses`) is not sent: each slot that falls due while it is
-- paused is claimed as usual and recorded `paused` (ledger state, final) instead of sent,
-- so that `runs` and `why` show it; `resume --catch-up` sends the newest of them. The
-- audit trail keeps who did what, when and why: pause, resume, trigger, backfill, rerun.
CREATE TABLE IF NOT EXISTS {pauses} (
    namespace  text        NOT NULL,
    entry      text        NOT NULL,
    paused_by  text        NOT NULL,
    reason     text,
    paused_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, entry)
);

ALTER TABLE {beat_sends} ADD COLUMN IF NOT EXISTS paused boolean NOT NULL DEFAULT false;

ALTER TABLE {runs} DROP CONSTRAINT IF EXISTS {runs_state_check};
ALTER TABLE {runs} ADD CONSTRAINT {runs_state_check}
    CHECK (state IN ('scheduled', 'running', 'succeeded', 'failed', 'skipped', 'paused'));

CREATE TABLE IF NOT EXISTS {audit} (
    id         bigserial   PRIMARY KEY,
    at         timestamptz NOT NULL DEFAULT now(),
    namespace  text        NOT NULL,
    action     text        NOT NULL,
    entry      text,
    lock_name  text,
    slot       text,
    actor      text        NOT NULL,
    reason     text,
    detail     jsonb       NOT NULL DEFAULT jsonb_build_object()
);
CREATE INDEX IF NOT EXISTS {audit_slot_idx} ON {audit} (lock_name, slot);
