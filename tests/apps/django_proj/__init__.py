"""A minimal Django project for django-celery-beat acceptance tests (settings from env)."""
