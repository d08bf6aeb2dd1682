"""The web dashboard (extra ``web``): every entry's runs, skips and freshness at a glance,
and steering, in the browser. ``celery -A proj pglock web`` serves it (waitress, loopback
by default); ``make_app(app)`` is the WSGI application to mount anywhere,
``make_asgi_app(app)`` its ASGI twin, ``celery_pglock.contrib.django.urls`` the Django
mount. Pages: ``web/_app.py``; buttons: ``web/_actions.py``; guards: ``web/security.py``.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from celery_pglock.web._app import Dashboard, Identify
from celery_pglock.web.security import Csrf

LOOPBACK = "127.0.0.1"
DEFAULT_PORT = 8555


def make_app(
    app: Celery, *, identify: Identify | None = None, csrf_key: bytes | None = None
) -> Dashboard:
    """The dashboard of ``app`` as a WSGI application. ``identify`` (default: the
    credentials of ``pglock_web_user``/``pglock_web_password``/``pglock_web_token``)
    tells who a request comes from; ``csrf_key``: the same in every process behind one
    address (default: a random one per process)."""
    return Dashboard(app, identify=identify, csrf=Csrf(csrf_key))


def make_asgi_app(app: Celery, **options: Any) -> Any:
    """The dashboard as an ASGI application (asgiref's WSGI adapter, in a thread pool)."""
    from asgiref.wsgi import WsgiToAsgi  # noqa: PLC0415 - only when asked for ASGI

    return WsgiToAsgi(make_app(app, **options))  # type: ignore[no-untyped-call]


def serve(app: Celery, host: str = LOOPBACK, port: int = DEFAULT_PORT, *, threads: int = 4) -> None:
    """Serve the dashboard on ``host:port`` with waitress until interrupted."""
    import waitress  # noqa: PLC0415 - the server only when serving

    waitress.serve(make_app(app), host=host, port=port, threads=threads, ident="celery-pglock")


__all__ = ["DEFAULT_PORT", "LOOPBACK", "Dashboard", "make_app", "make_asgi_app", "serve"]
