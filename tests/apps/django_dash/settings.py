"""Settings: Django's own tables in the test's schema (``search_path``), the dashboard of
``tests.apps.testapp`` (``PGLOCK_DASHBOARD_APP``, outside Celery's ``CELERY_`` namespace)."""

from __future__ import annotations

from tests.apps.django_proj import settings as django_proj

SECRET_KEY = "celery-pglock-dashboard-tests-only"  # noqa: S105 - a throwaway test project
DEBUG = False
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "celery_pglock.contrib.django",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
ROOT_URLCONF = "tests.apps.django_dash.urls"
LOGIN_URL = "/admin/login/"
PGLOCK_DASHBOARD_APP = "tests.apps.testapp:app"
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
DATABASES = django_proj.DATABASES  # the test's schema, through search_path
