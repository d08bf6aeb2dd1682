-- celery-pglock schema, version 11: schedule entries that live in PostgreSQL, changed at
-- runtime (`celery_pglock.schedules`, `celery pglock entries`) without a redeploy. Beside
-- the entries of `beat_schedule`, in one namespace of names (the code's win a name both
-- define). A removed entry stays as a tombstone (`removed`), so that a replica that
-- read the table before learns of the removal by the changes since its version.
--
-- `schedule` is a JSON object of one kind: "every" (seconds), "cron" ("m h dom mon dow",
-- with "tz", a zone, or the app's), "solar" (an event, with "lat" and "lon") or "at" (a
-- time, once);
-- `options` the send options Celery takes (queue, exchange, routing_key, priority,
-- expires, headers); `pglock` the library's per-entry options (overlap, concurrency,
-- catch_up, overdue_after). `version` is the namespace's change number when the row
-- last changed: every change takes the next one (`entry_versions`), so that a beat
-- replica reads only the rows changed since the number it has seen.
CREATE TABLE IF NOT EXISTS {entries} (
    namespace   text        NOT NULL,
    name        text        NOT NULL,
    task        text        NOT NULL,
    schedule    jsonb       NOT NULL,
    args        jsonb       NOT NULL DEFAULT jsonb_build_array(),
    kwargs      jsonb       NOT NULL DEFAULT jsonb_build_object(),
    options     jsonb       NOT NULL DEFAULT jsonb_build_object(),
    pglock      jsonb       NOT NULL DEFAULT jsonb_build_object(),
    starts_at   timestamptz,
    ends_at     timestamptz,
    enabled     boolean     NOT NULL DEFAULT true,
    removed     boolean     NOT NULL DEFAULT false,
    version     bigint      NOT NULL,
    changed_by  text        NOT NULL,
    changed_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (namespace, name)
);
CREATE INDEX IF NOT EXISTS {entries_version_idx} ON {entries} (namespace, version);

-- The newest change number of each namespace: one row read per beat tick.
CREATE TABLE IF NOT EXISTS {entry_versions} (
    namespace  text   PRIMARY KEY,
    version    bigint NOT NULL
);
