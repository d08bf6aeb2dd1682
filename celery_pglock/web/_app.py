"""The dashboard as a WSGI application: pages (server-rendered HTML, inline SVG, no
JavaScript), their JSON twins under ``/api/``, and the actions (``web/_actions.py``).

Each request opens its own labelled connection (JIT off: a named statement), reads through
``celery_pglock.steering`` and closes it. Every page and response carries the headers of
``web/security.py``; templates escape every value (Jinja2's autoescape), so a beat entry
named ``<script>…`` shows as text. No DSN or password is ever rendered: errors are the
library's, which never hold one.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from importlib import resources
from typing import Any

from celery import Celery
from jinja2 import Environment, PackageLoader
from werkzeug.exceptions import HTTPException, MethodNotAllowed, NotFound
from werkzeug.routing import Map, MapAdapter, Rule
from werkzeug.wrappers import Request, Response

from celery_pglock import ops, schedules
from celery_pglock._config import app_settings, web_credentials
from celery_pglock._dsn import redact
from celery_pglock.errors import (
    ConfigurationError,
    DatabaseUnavailable,
    PgLockError,
    SchemaMissing,
    UnknownEntry,
)
from celery_pglock.steering import _history as history
from celery_pglock.steering import _operator as operator
from celery_pglock.steering import _reads as reads
from celery_pglock.steering._apps import namespace
from celery_pglock.store.statements import Statements
from celery_pglock.web import _actions as actions
from celery_pglock.web import _svg as svg
from celery_pglock.web.security import HEADERS, Credentials, Csrf, Identity

Identify = Callable[[Request], Identity]
MAX_HOURS = 24 * 31
REFRESH_CHOICES = (0, 10, 30, 60)
# An age this near zero, either side, reads "just now": a page's moment is taken before it
# reads, so a run may end after it, and PostgreSQL's clock (which stamps the ledger) may be
# a little ahead of the dashboard's.
JUST_NOW = 1.0  # seconds
RETRY_EVERY = 10  # seconds between a page's own reloads while PostgreSQL is unreachable

URLS = Map(
    [
        Rule("/", endpoint="overview"),
        Rule("/entry/<path:name>", endpoint="entry"),
        Rule("/slot", endpoint="slot"),
        Rule("/locks", endpoint="locks"),
        Rule("/audit", endpoint="audit"),
        Rule("/stored", endpoint="stored"),
        Rule("/api/overview", endpoint="api_overview"),
        Rule("/api/entry/<path:name>", endpoint="api_entry"),
        Rule("/api/slot", endpoint="api_slot"),
        Rule("/api/locks", endpoint="api_locks"),
        Rule("/api/audit", endpoint="api_audit"),
        Rule("/action/<kind>", endpoint="action", methods=["POST"]),
        Rule("/static/style.css", endpoint="style"),
    ],
    strict_slashes=False,
)


class Dashboard:
    """The WSGI application (``make_app``). ``identify``: who a request comes from and
    what they may do (standalone: the configured credentials; Django: its users)."""

    def __init__(self, app: Celery, *, identify: Identify | None = None, csrf: Csrf | None = None):
        self.app = app
        self.csrf = csrf or Csrf()
        if identify is None:
            credentials = Credentials(web_credentials(app.conf))
            self.actions_configured = credentials.configured
            identify = _standalone(credentials)
        else:
            self.actions_configured = True
        self.identify = identify
        self.templates = Environment(
            loader=PackageLoader("celery_pglock.web", "templates"), autoescape=True
        )
        self.templates.filters.update(
            when=_when, age=_age, ago=_ago, seconds=_seconds, pretty=_pretty
        )

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        request = Request(environ)
        response = self.respond(request, self.identify(request))
        return response(environ, start_response)

    def respond(self, request: Request, identity: Identity) -> Response:
        """The response to ``request`` from ``identity``, with the security headers."""
        urls = URLS.bind_to_environ(request.environ)
        try:
            endpoint, values = urls.match()
            if not identity.can_read:
                response = self.page(
                    request,
                    urls,
                    identity,
                    "error.html",
                    status=403,
                    message="You may not read this dashboard.",
                )
            else:
                response = getattr(self, f"on_{endpoint}")(request, urls, identity, **values)
        except UnknownEntry as exc:
            response = self.error(request, urls, identity, 404, str(exc))
        except SchemaMissing as exc:
            response = self.error(request, urls, identity, 404, str(exc))
        except ConfigurationError as exc:
            response = self.error(request, urls, identity, 400, str(exc))
        except DatabaseUnavailable as exc:
            response = self.unreachable(request, urls, identity, str(exc))
        except PgLockError as exc:
            response = self.error(request, urls, identity, 500, str(exc))
        except MethodNotAllowed as exc:
            response = self.error(request, urls, identity, 405, "Actions are POST only.")
            response.headers["Allow"] = ", ".join(exc.valid_methods or ())
        except NotFound:
            response = self.error(request, urls, identity, 404, "No such page.")
        except HTTPException as exc:
            response = self.error(request, urls, identity, exc.code or 500, exc.description or "")
        response.headers.update(HEADERS)
        return response

    # -- the connection ------------------------------------------------------------------

    @contextmanager
    def connection(self) -> Iterator[Statements]:
        with operator.connection(self.app, actions.LABEL) as statements:
            statements.run("web_jit_off")
            yield statements

    # -- pages ---------------------------------------------------------------------------

    def on_overview(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        with self.connection() as statements:
            found = history.overview(self.app, statements, page=_page(request))
        strips = {entry["entry"]: svg.strip_svg(entry["strip"]) for entry in found["entries"]}
        return self.page(request, urls, identity, "overview.html", found=found, strips=strips)

    def on_api_overview(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        with self.connection() as statements:
            return _json(history.overview(self.app, statements, page=_page(request)))

    def _entry(self, request: Request, name: str) -> dict[str, Any]:
        hours = min(MAX_HOURS, max(1, _int(request.args.get("hours"), 24)))
        page = max(0, _int(request.args.get("page"), 0))
        until = datetime.now(timezone.utc)
        since = until - timedelta(hours=hours)
        with self.connection() as statements:
            found = history.entry_history(
                self.app, statements, name, since=since, until=until, page=page
            )
        found["hours"] = hours
        return found

    def on_entry(
        self, request: Request, urls: MapAdapter, identity: Identity, name: str
    ) -> Response:
        found = self._entry(request, name)
        drawn = svg.timeline(
            found["runs"],
            found["skips"],
            found["waiting"],
            since=found["since"],
            until=found["until"],
        )
        return self.page(request, urls, identity, "entry.html", found=found, timeline=drawn)

    def on_api_entry(
        self, request: Request, urls: MapAdapter, identity: Identity, name: str
    ) -> Response:
        return _json(self._entry(request, name))

    def _slot(self, request: Request) -> dict[str, Any]:
        name, slot = request.args.get("name", ""), request.args.get("slot", "")
        if not name or not slot:
            raise ConfigurationError("give name (an entry, task or lock) and slot")
        with self.connection() as statements:
            return reads.why(self.app, statements, name, slot)

    def on_slot(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        found = self._slot(request)
        return self.page(
            request, urls, identity, "slot.html", found=found, name=request.args.get("name")
        )

    def on_api_slot(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        return _json(self._slot(request))

    def _status(self, request: Request) -> reads.StatusView:
        skips = max(0, _int(request.args.get("skips"), 10))
        with self.connection() as statements:
            return reads.status(self.app, statements, skips=skips)

    def on_locks(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        view = self._status(request)
        return self.page(request, urls, identity, "locks.html", view=view, state=view.as_json())

    def on_api_locks(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        return _json(self._status(request).as_json())

    def _audit(self, request: Request) -> dict[str, Any]:
        page = max(0, _int(request.args.get("page"), 0))
        entry = request.args.get("entry") or None
        with self.connection() as statements:
            rows = history.audit_trail(
                statements,
                namespace(self.app),
                entry=entry,
                lock_name=entry,
                limit=history.PAGE + 1,
                offset=page * history.PAGE,
            )
        return {
            "page": page,
            "entry": entry,
            "rows": rows[: history.PAGE],
            "more": len(rows) > history.PAGE,
        }

    def on_audit(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        return self.page(request, urls, identity, "audit.html", found=self._audit(request))

    def on_api_audit(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        return _json(self._audit(request))

    def on_stored(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        """The schedule entries stored in PostgreSQL, and a form to add or change one."""
        found = schedules.entries(self.app)
        editing = next((e for e in found if e.name == request.args.get("edit")), None)
        # As text the template escapes: JSON in an attribute must not end it early.
        as_text = {}
        if editing is not None:
            as_text = {"args": json.dumps(editing.args), "kwargs": json.dumps(editing.kwargs)}
        return self.page(
            request,
            urls,
            identity,
            "stored.html",
            entries=found,
            editing=editing,
            editing_json=as_text,
        )

    def on_style(self, request: Request, urls: MapAdapter, identity: Identity) -> Response:
        text = resources.files("celery_pglock.web").joinpath("static/style.css").read_text()
        return Response(text, mimetype="text/css")

    def on_action(
        self, request: Request, urls: MapAdapter, identity: Identity, kind: str
    ) -> Response:
        return actions.handle(self, request, urls, identity, kind)

    # -- rendering -----------------------------------------------------------------------

    def page(
        self,
        request: Request,
        urls: MapAdapter,
        identity: Identity,
        template: str,
        *,
        status: int = 200,
        refresh: int | None = None,
        **context: Any,
    ) -> Response:
        """``template`` rendered; ``refresh``: seconds between its own reloads, else the
        request's ``?refresh=`` choice."""
        if refresh is None:
            refresh = _int(request.args.get("refresh"), 0)
            refresh = refresh if refresh in REFRESH_CHOICES else 0
        html = self.templates.get_template(template).render(
            url=urls.build,
            notice=self.csrf.sealed(request.args.get("done"), request.args.get("sig")),
            identity=identity,
            csrf=self.csrf.token(identity) if identity.can_act else "",
            actions_configured=self.actions_configured,
            refresh=refresh,
            namespace=namespace(self.app),
            **context,
        )
        return Response(html, status=status, mimetype="text/html")

    def error(
        self,
        request: Request,
        urls: MapAdapter,
        identity: Identity,
        status: int,
        message: str,
        **context: Any,
    ) -> Response:
        """``message`` (no DSN in it) as JSON under ``/api/``, else as a page (``context``:
        its ``heading``, ``hint``, ``refresh``)."""
        message = self._without_dsn(message)
        if request.path.startswith("/api/"):
            return _json({"error": message}, status=status)
        return self.page(
            request, urls, identity, "error.html", status=status, message=message, **context
        )

    def unreachable(
        self, request: Request, urls: MapAdapter, identity: Identity, message: str
    ) -> Response:
        """503 while PostgreSQL is unreachable: what happened, and that the page recovers
        by itself. A page reloads itself every ``RETRY_EVERY`` s (a meta refresh, which the
        Content-Security-Policy leaves alone: it is no script); an action's answer does not
        (its reload would GET the action)."""
        if request.method in ("GET", "HEAD"):
            hint = (
                "This page works again as soon as it answers; it reloads itself every "
                f"{RETRY_EVERY} s, or reload it."
            )
            refresh: int | None = RETRY_EVERY
        else:
            hint = (
                "The action may not have been done: once PostgreSQL answers, the entry's page "
                "and the audit trail show whether it was; try it again then."
            )
            refresh = 0
        response = self.error(
            request,
            urls,
            identity,
            503,
            message,
            heading="PostgreSQL is unreachable",
            hint=hint,
            refresh=refresh,
        )
        response.headers["Retry-After"] = str(RETRY_EVERY)
        return response

    def _without_dsn(self, message: str) -> str:
        """The library names the server by its DSN (password masked) in its errors: the
        dashboard shows no DSN at all."""
        try:
            dsn = app_settings(self.app).dsn
        except ConfigurationError:
            return message
        return message.replace(f"PostgreSQL at {redact(dsn)!r}", "PostgreSQL")


def _standalone(credentials: Credentials) -> Identify:
    def identify(request: Request) -> Identity:
        return credentials.identify(request.headers.get("Authorization"))

    return identify


def _json(payload: Any, status: int = 200) -> Response:
    text = json.dumps(ops.jsonable(payload), indent=2)
    return Response(text, status=status, mimetype="application/json")


def _page(request: Request) -> int:
    return max(0, _int(request.args.get("page"), 0))


def _int(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default


def _when(moment: datetime | str | None) -> str:
    """A moment in UTC to the second; the JSON views' ISO text too (the locks page)."""
    if isinstance(moment, str):
        try:
            moment = datetime.fromisoformat(moment.replace("Z", "+00:00"))
        except ValueError:
            return str(moment)
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC") if moment else "-"


def _age(seconds: float | None) -> str:
    """A length of time (never negative: an age is ``_ago``'s), in its largest unit."""
    if seconds is None:
        return "-"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _ago(seconds: float | None) -> str:
    """How long before the page's moment a moment of the ledger was: "just now" within
    ``JUST_NOW``, and a moment further ahead said to be ahead, never "-5 s ago"."""
    if seconds is None:
        return "-"
    if abs(seconds) < JUST_NOW:
        return "just now"
    if seconds < 0:
        return f"{_age(-seconds)} ahead (PostgreSQL's clock is ahead of the dashboard's)"
    return f"{_age(seconds)} ago"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _pretty(value: Any) -> str:
    return json.dumps(ops.jsonable(value), indent=1, sort_keys=True)
