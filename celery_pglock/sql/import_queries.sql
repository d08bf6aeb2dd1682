-- What `celery pglock entries import` reads from other schedulers' stores. These tables
-- are not the library's: django-celery-beat's, in the Django database's search_path.

-- name: import_django_entries
-- django-celery-beat's periodic tasks with their schedule, of whichever kind each has
-- (celery.backend_cleanup, the entry it adds itself, aside).
SELECT t.name, t.task, t.args, t.kwargs, t.queue, t.exchange, t.routing_key, t.headers,
       t.priority, t.expires, t.expire_seconds, t.one_off, t.start_time, t.enabled,
       i.every AS interval_every, i.period AS interval_period,
       c.minute, c.hour, c.day_of_month, c.month_of_year, c.day_of_week,
       c.timezone AS cron_timezone,
       s.event AS solar_event, s.latitude, s.longitude,
       k.clocked_time
  FROM django_celery_beat_periodictask t
  LEFT JOIN django_celery_beat_intervalschedule i ON i.id = t.interval_id
  LEFT JOIN django_celery_beat_crontabschedule c ON c.id = t.crontab_id
  LEFT JOIN django_celery_beat_solarschedule s ON s.id = t.solar_id
  LEFT JOIN django_celery_beat_clockedschedule k ON k.id = t.clocked_id
 WHERE t.task <> 'celery.backend_cleanup'
 ORDER BY t.name;
