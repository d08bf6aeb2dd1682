"""A user's Celery app, retrofitted as README.md says."""

from celery import Celery

import celery_pglock  # noqa: F401  (before the app: its tasks are locked as they are created)

app = Celery("proj")
app.conf.update(
    broker_url="memory://",
    result_backend="cache+memory://",
    pglock_all_tasks=True,
)


@app.task(name="proj.nightly_report")
def nightly_report(day: str) -> str:
    return f"report for {day}"
