-- celery-pglock schema, version 3: a slot that will not run is final, `skipped`.
-- Beat writes a slot's row `scheduled` when it sends the message. When that message is
-- skipped before any attempt (`locked` by an older slot still running, `superseded`,
-- `late`), nothing else would ever run the slot, and the row stayed `scheduled`, shown
-- as waiting, until retention pruned it. The skip now records it `skipped`, with the
-- reason; a later message of the slot may still claim it, as a `failed` one.
ALTER TABLE {runs} DROP CONSTRAINT IF EXISTS {runs_state_check};
ALTER TABLE {runs} ADD CONSTRAINT {runs_state_check}
    CHECK (state IN ('scheduled', 'running', 'succeeded', 'failed', 'skipped'));
