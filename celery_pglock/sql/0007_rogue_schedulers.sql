-- celery-pglock schema, version 7: telling a stock `celery beat` (or an old deploy) still
-- running beside the PgLockScheduler replicas. The beat leader keeps the tasks its entries
-- send in `beat_tasks` (refreshed every minute); a worker that receives a message of one of
-- them without a slot, while such a leader is active, records it in `rogue_sends` (once
-- per task and sender per hour) and logs a WARNING.
CREATE TABLE IF NOT EXISTS {beat_tasks} (
    namespace  text        NOT NULL,
    task_name  text        NOT NULL,
    entry      text        NOT NULL,
    seen_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, task_name)
);

CREATE TABLE IF NOT EXISTS {rogue_sends} (
    namespace  text        NOT NULL,
    task_name  text        NOT NULL,
    origin     text        NOT NULL,
    first_at   timestamptz NOT NULL DEFAULT now(),
    last_at    timestamptz NOT NULL DEFAULT now(),
    reports    integer     NOT NULL DEFAULT 1,
    PRIMARY KEY (namespace, task_name, origin)
);
