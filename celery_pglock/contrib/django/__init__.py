"""The ledger in Django's admin, read-only: add ``"celery_pglock.contrib.django"`` to
``INSTALLED_APPS``. Runs, skips and holders are listed as celery-pglock writes them; the
app creates no table and no migration, and nothing can be changed from the admin.

The tables are found from the settings Celery reads (``CELERY_PGLOCK_SCHEMA``,
``CELERY_PGLOCK_TABLE_PREFIX``), with celery-pglock's defaults.
"""
