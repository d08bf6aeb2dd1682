"""The dashboard inside a Django project: Django's users, sessions and permissions.

Staff users read; users with the permission ``celery_pglock.steer`` also act (audited as
``web:<username>``); anyone else is sent to the login page (``LOGIN_URL``) or refused.
The Celery app is named by the Django setting ``PGLOCK_DASHBOARD_APP`` (``"proj.celery:app"``;
not ``CELERY_…``: Celery would read that as a ``pglock_*`` setting of its own). The
dashboard's forms carry its own CSRF token (an HMAC bound to the user) and are checked
for their Origin, so the view is exempt from Django's CSRF middleware.
"""

from __future__ import annotations

import io
from functools import cache
from typing import Any

from celery.utils.imports import symbol_by_name
from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpResponse
from django.views.decorators.csrf import csrf_exempt
from werkzeug.wrappers import Request

from celery_pglock.contrib.django import DASHBOARD_APP_SETTING as SETTING
from celery_pglock.errors import ConfigurationError
from celery_pglock.web import Dashboard, make_app
from celery_pglock.web.security import ANONYMOUS, Identity

PERMISSION = "celery_pglock.steer"


@cache
def dashboard() -> Dashboard:
    """The dashboard of the Celery app ``PGLOCK_DASHBOARD_APP`` names (built once)."""
    name = getattr(settings, SETTING, None)
    if not name:
        raise ConfigurationError(f"set {SETTING} to your Celery app, e.g. 'proj.celery:app'")
    key = getattr(settings, "SECRET_KEY", "").encode() or None
    return make_app(symbol_by_name(name), identify=_by_django, csrf_key=key)


def _by_django(request: Request) -> Identity:
    """Never asked: ``view`` tells the dashboard who the Django user is."""
    return ANONYMOUS


@csrf_exempt  # type: ignore[untyped-decorator]  # Django has no type hints
def view(request: Any, rest: str = "") -> HttpResponse:
    """Every page and action of the dashboard under the URL this view is included at."""
    user = request.user
    if not user.is_authenticated:
        return redirect_to_login(request.get_full_path())
    identity = Identity(
        user.get_username(), can_read=bool(user.is_staff), can_act=user.has_perm(PERMISSION)
    )
    environ = dict(request.META)
    body = request.body
    environ["wsgi.input"] = io.BytesIO(body)
    environ["CONTENT_LENGTH"] = str(len(body))
    mounted = request.path[: len(request.path) - len(rest)].rstrip("/")
    environ["SCRIPT_NAME"] = mounted
    environ["PATH_INFO"] = "/" + rest
    answer = dashboard().respond(Request(environ), identity)
    response = HttpResponse(answer.get_data(), status=answer.status_code)
    for header, value in answer.headers.items():
        if header.lower() != "content-length":
            response[header] = value
    return response
