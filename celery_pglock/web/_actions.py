"""The dashboard's buttons: pause, resume, trigger, rerun, backfill, release a lock, and
add, change or remove a schedule entry stored in PostgreSQL (``celery_pglock.schedules``).

Each is a POST, twice: first ``step=review`` (what would happen: a backfill's dry run,
the holder a release would end), then ``step=confirm`` from the confirmation page, which
redirects (303) to the page that tells the outcome (``_done``). Both need an identity
allowed to act (never anonymous), a CSRF token made for that identity, and an Origin (or
Referer) of this dashboard; a refused request changes nothing. Each
confirmed action is the CLI's own (``steering.actions``), audited as the web user
(``web:<user>``), its slots sent in the background.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from werkzeug.routing import MapAdapter
from werkzeug.utils import redirect
from werkzeug.wrappers import Request, Response

from celery_pglock import _controls as controls
from celery_pglock import ops
from celery_pglock._messages import checked_slot
from celery_pglock.errors import ConfigurationError
from celery_pglock.ops import Row
from celery_pglock.steering import _replay as replay
from celery_pglock.steering import actions
from celery_pglock.steering._apps import Schedule
from celery_pglock.steering._operator import Operator
from celery_pglock.web import _entries as entries
from celery_pglock.web.security import Identity, same_origin

if TYPE_CHECKING:
    from celery_pglock.web._app import Dashboard

KINDS = ("pause", "resume", "trigger", "rerun", "backfill", "release")
ENTRY_KINDS = ("entry_add", "entry_edit", "entry_remove")  # stored entries (``_entries``)
BACKFILL_LIMIT = actions.BACKFILL_LIMIT
BACKFILL_RATE = 1.0  # slots per second
LABEL = "celery-pglock web"


def handle(
    board: Dashboard, request: Request, urls: MapAdapter, identity: Identity, kind: str
) -> Response:
    """Check who asks and how, then review or do ``kind``."""
    if kind not in KINDS + ENTRY_KINDS:
        return board.error(request, urls, identity, 404, f"no action {kind!r}")
    refused = _refusal(board, request, urls, identity)
    if refused is not None:
        return refused
    fields = {
        key: request.form.get(key, "").strip()
        for key in request.form
        if key not in ("csrf", "step")
    }
    if request.form.get("step") == "confirm":
        if kind in ENTRY_KINDS:
            done = entries.do(board.app, identity.actor, kind, fields)
        else:
            done = _do(board, identity, kind, fields)
        return _done(board, urls, identity, kind, fields=fields, done=done)
    preview = _review(board, identity, kind, fields)
    return board.page(
        request, urls, identity, "confirm.html", kind=kind, fields=fields, preview=preview
    )


def _done(
    board: Dashboard,
    urls: MapAdapter,
    identity: Identity,
    kind: str,
    *,
    fields: dict[str, str],
    done: Row,
) -> Response:
    """Post/redirect/get: a confirmed action answers 303 See Other to the page of what it
    acted on (the entry's; a rerun's slot; the locks page for a release), which shows the
    outcome once as a notice: a reload of that page reads, never acts again.

    The notice travels in the redirect's query string (``done``), as text with its seal
    (``sig``, an HMAC under the process's key): stateless (no session or store to keep),
    and a page shows only a notice this dashboard wrote, so a crafted link cannot claim an
    action that was not done. It names what every page shows (entry, slot, lock, who),
    nothing secret; the template escapes it."""
    at = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    said = entries.outcome(kind, identity.actor, done) if kind in ENTRY_KINDS else None
    text = f"{kind}: done at {at} — {said or _outcome(kind, identity, done)}"
    endpoint, values = _landing(kind, fields, done)
    location = urls.build(endpoint, {**values, "done": text, "sig": board.csrf.seal(text)})
    return redirect(location, code=303)


def _landing(kind: str, fields: dict[str, str], done: Row) -> tuple[str, dict[str, Any]]:
    """The page a confirmed ``kind`` redirects to: endpoint and values."""
    if kind == "release":
        return "locks", {}
    if kind in ENTRY_KINDS:
        return "stored", {}
    if kind == "rerun":
        return "slot", {"name": fields["entry"], "slot": done["slot"]}
    return "entry", {"name": fields["entry"]}


def _outcome(kind: str, identity: Identity, done: Row) -> str:
    """What a confirmed ``kind`` did, in a sentence, from the action's own answer."""
    who = identity.actor
    if kind == "pause":
        said = f": {done['reason']}" if done.get("reason") else ""
        already = "" if done["new"] else "already "
        return f"{already}paused by {done['paused_by']}{said}"
    if kind == "resume":
        held = len(done["caught_up"])
        return f"resumed by {who}" + (f"; {held} slot(s) held back being sent" if held else "")
    if kind == "trigger":
        sent = f"of {done['entry']} sent by {who}"
        return f"slot {done['slot']} " + (sent if done["send"] else "already succeeded: not sent")
    if kind == "rerun":
        return f"slot {done['slot']} of {done['lock_name']} sent again by {who}"
    if kind == "backfill":
        sending, planned = len(done["sending"]), len(done["slots"])
        return (
            f"{sending} slot(s) of {done['entry']} being sent, one a second, by {who}"
            f" ({planned - sending} of the range left: they ran)"
        )
    ended = len(done["terminated"])
    return f"lock {done['lock']} released by {who}: {ended} holder(s) ended"


def _refusal(
    board: Dashboard, request: Request, urls: MapAdapter, identity: Identity
) -> Response | None:
    """Why this POST is refused (nothing changed), or None: who may act, its Origin, its
    CSRF token."""
    if identity.name is not None and not identity.can_act:
        return board.error(request, urls, identity, 403, f"{identity.name} may not act here.")
    if not identity.can_act:
        response = board.error(request, urls, identity, 401, _unproven(identity))
        if board.actions_configured:
            response.headers["WWW-Authenticate"] = 'Basic realm="celery-pglock", charset="UTF-8"'
        return response
    if not same_origin(
        request.headers.get("Origin"), request.headers.get("Referer"), request.host_url
    ):
        return board.error(
            request, urls, identity, 403, "Refused: the request did not come from this dashboard."
        )
    if not board.csrf.check(identity, request.form.get("csrf")):
        return board.error(
            request,
            urls,
            identity,
            403,
            "Refused: the form's token is missing, wrong or expired; reload the page.",
        )
    return None


def _unproven(identity: Identity) -> str:
    """Why an anonymous request may not act: the credentials it sent are wrong (only ever
    said where some are configured: ``Credentials.identify``), or it sent none (asked for,
    and how the server sets them)."""
    if identity.wrong_credentials:
        return "Wrong user name, password or token."
    return (
        "Actions need credentials (pglock_web_user and pglock_web_password, or pglock_web_token)."
    )


def _operator(board: Dashboard, identity: Identity) -> Operator:
    return Operator(board.app, identity.actor, LABEL)


def _required(fields: dict[str, str], name: str, what: str) -> str:
    if not fields.get(name):
        raise ConfigurationError(f"{what} is required")
    return fields[name]


def _review(board: Dashboard, identity: Identity, kind: str, fields: dict[str, str]) -> Row:
    """What ``kind`` would do with ``fields``; nothing is changed."""
    if kind in ENTRY_KINDS:
        return entries.review(board.app, kind, fields)
    op = _operator(board, identity)
    if kind == "release":
        name = actions.lock_to_release(op, _required(fields, "lock", "the lock's name"))
        with board.connection() as statements:
            return {"holders": ops.holders(statements, name)}
    schedule = Schedule(board.app)
    if kind == "rerun":
        _required(fields, "reason", "a reason")
        entry, lock = replay.entry_of(schedule, _required(fields, "entry", "the entry"))
        slot = checked_slot("slot", _required(fields, "slot", "the slot"))
        with board.connection() as statements:
            return {"row": controls.run_row(statements, lock, slot), "lock_name": lock}
    entry = schedule.entry(_required(fields, "entry", "the entry"))
    if kind == "backfill":
        start, end = _window(fields)
        planned = actions.backfill_plan(op, entry.name, start, end, limit=BACKFILL_LIMIT)
        return {"plan": planned.plan, "lock_name": planned.lock}
    return {"lock_name": schedule.lock_name(entry)}


def _window(fields: dict[str, str]) -> tuple[datetime, datetime]:
    start = actions.moment(_required(fields, "from", "from"))
    return start, actions.moment(_required(fields, "to", "to"))


def _do(board: Dashboard, identity: Identity, kind: str, fields: dict[str, str]) -> Row:
    """Do ``kind``: the actions the CLI does, audited as ``web:<user>``; their slots are
    sent in the background (the page answers at once)."""
    op = _operator(board, identity)
    send = replay.in_background()
    if kind == "release":
        return actions.release(op, _required(fields, "lock", "the lock's name")).as_json()
    if kind == "rerun":
        reason = _required(fields, "reason", "a reason")
        slot = _required(fields, "slot", "the slot")
        return actions.rerun(op, _required(fields, "entry", "the entry"), slot, reason, send=send)
    entry = _required(fields, "entry", "the entry")
    if kind == "pause":
        return actions.pause(op, entry, fields.get("reason") or None)
    if kind == "resume":
        return actions.resume(op, entry, catch_up=bool(fields.get("catch_up")), send=send)
    if kind == "trigger":
        return actions.trigger(op, entry, slot=None, send=send)
    start, end = _window(fields)
    paced = replay.in_background(BACKFILL_RATE)
    return actions.backfill(op, entry, start, end, send=paced, limit=BACKFILL_LIMIT).as_json()
