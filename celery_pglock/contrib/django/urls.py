"""The dashboard's URLs for a Django project:
``path("pglock/", include("celery_pglock.contrib.django.urls"))`` (see ``views``)."""

from __future__ import annotations

from django.urls import re_path

from celery_pglock.contrib.django.views import view

app_name = "celery_pglock"
urlpatterns = [re_path(r"^(?P<rest>.*)$", view, name="dashboard")]
