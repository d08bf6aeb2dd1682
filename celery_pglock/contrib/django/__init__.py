"""The ledger in Django's admin, read-only: add ``"celery_pglock.contrib.django"`` to
``INSTALLED_APPS``. Runs, skips and holders are listed as celery-pglock writes them; the
app creates no table and no migration, and nothing can be changed from the admin.

The tables are found from the settings Celery reads (``CELERY_PGLOCK_SCHEMA``,
``CELERY_PGLOCK_TABLE_PREFIX``), with celery-pglock's defaults.

The web dashboard mounts with ``path("pglock/", include("celery_pglock.contrib.django.urls"))``
and the setting ``PGLOCK_DASHBOARD_APP`` (see ``views``).
"""

#: The Django setting naming the dashboard's Celery app. Not ``CELERY_…``: Celery's
#: ``namespace="CELERY"`` would read that as a ``pglock_*`` setting, and an unknown one
#: stops every worker.
DASHBOARD_APP_SETTING = "PGLOCK_DASHBOARD_APP"
