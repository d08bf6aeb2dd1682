"""The dashboard's buttons: pause, resume, trigger, rerun, backfill, release a lock.

Each is a POST, twice: first ``step=review`` (what would happen: a backfill's dry run,
the holder a release would end), then ``step=confirm`` from the confirmation page. Both
need an identity allowed to act (never anonymous), a CSRF token made for that identity,
and an Origin (or Referer) of this dashboard; a refused request changes nothing. Each
calls the function the CLI calls (``celery_pglock.controls``, ``steering.replay``) and is
audited with the web user (``web:<user>``).
"""

from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from werkzeug.routing import MapAdapter
from werkzeug.wrappers import Request, Response

from celery_pglock import controls, ops
from celery_pglock.beat.settings import BeatSettings
from celery_pglock.config import app_settings
from celery_pglock.errors import ConfigurationError, PgLockError
from celery_pglock.messages import checked_slot
from celery_pglock.steering import operator, replay
from celery_pglock.steering.apps import Schedule, namespace
from celery_pglock.web.security import Identity, same_origin

if TYPE_CHECKING:
    from celery_pglock.web.app import Dashboard

logger = logging.getLogger("celery_pglock.web")

KINDS = ("pause", "resume", "trigger", "rerun", "backfill", "release")
BACKFILL_LIMIT = 100
BACKFILL_RATE = 1.0  # slots per second
SEND_LABEL = "celery-pglock web send"


def handle(
    board: Dashboard, request: Request, urls: MapAdapter, identity: Identity, kind: str
) -> Response:
    """Check who asks and how, then review or do ``kind``."""
    if kind not in KINDS:
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
        done = _do(board, identity, kind, fields)
        return board.page(request, urls, identity, "done.html", kind=kind, fields=fields, done=done)
    preview = _review(board, kind, fields)
    return board.page(
        request, urls, identity, "confirm.html", kind=kind, fields=fields, preview=preview
    )


def _refusal(
    board: Dashboard, request: Request, urls: MapAdapter, identity: Identity
) -> Response | None:
    """Why this POST is refused (nothing changed), or None: who may act, its Origin, its
    CSRF token."""
    if identity.name is not None and not identity.can_act:
        return board.error(request, urls, identity, 403, f"{identity.name} may not act here.")
    if not identity.can_act:
        response = board.error(
            request,
            urls,
            identity,
            401,
            "Actions need credentials (pglock_web_user and pglock_web_password, or "
            "pglock_web_token).",
        )
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


def _target(board: Dashboard, identity: Identity) -> controls.Target:
    return controls.Target(app_settings(board.app).tables, namespace(board.app), identity.actor)


def _required(fields: dict[str, str], name: str, what: str) -> str:
    if not fields.get(name):
        raise ConfigurationError(f"{what} is required")
    return fields[name]


def _review(board: Dashboard, kind: str, fields: dict[str, str]) -> dict[str, Any]:
    """What ``kind`` would do with ``fields``; nothing is changed."""
    if kind == "release":
        name = _lock_in_namespace(board, _required(fields, "lock", "the lock's name"))
        with board.session() as (conn, tables):
            return {"holders": ops.holders(conn, tables, name)}
    schedule = Schedule(board.app)
    if kind == "rerun":
        _required(fields, "reason", "a reason")
        entry, lock = replay.entry_of(schedule, _required(fields, "entry", "the entry"))
        slot = checked_slot("slot", _required(fields, "slot", "the slot"))
        with board.session() as (conn, tables):
            return {"row": controls.run_row(conn, tables, lock, slot), "lock_name": lock}
    entry = schedule.entry(_required(fields, "entry", "the entry"))
    if kind == "backfill":
        return {
            "plan": _plan(board, schedule, entry, fields),
            "lock_name": schedule.lock_name(entry),
        }
    return {"lock_name": schedule.lock_name(entry)}


def _plan(
    board: Dashboard, schedule: Schedule, entry: Any, fields: dict[str, str]
) -> list[dict[str, Any]]:
    start = _moment(_required(fields, "from", "from"))
    end = _moment(_required(fields, "to", "to"))
    if end < start:
        raise ConfigurationError("to is before from: swap them")
    wanted = replay.slots_between(board.app, entry, start, end, BACKFILL_LIMIT)
    if not wanted:
        raise ConfigurationError(f"{entry.name} has no slot in that range")
    with board.session() as (conn, tables):
        rows = controls.slot_rows(conn, tables, schedule.lock_name(entry), wanted)
    return replay.plan(rows, wanted)


def _moment(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(f"{text!r} is not an ISO-8601 time") from None
    if parsed.tzinfo is None:  # ambiguous: the CLI refuses it too, nothing is guessed
        raise ConfigurationError(f"{text!r} has no UTC offset: add Z or +HH:MM")
    return parsed.astimezone(timezone.utc)


def _lock_in_namespace(board: Dashboard, name: str) -> str:
    prefix = f"{namespace(board.app)}:"
    if not name.startswith(prefix):
        raise ConfigurationError(f"{name!r} is outside this app's namespace {prefix!r}")
    return name


def _do(board: Dashboard, identity: Identity, kind: str, fields: dict[str, str]) -> dict[str, Any]:
    """Do ``kind``: the same functions as the CLI, audited as ``web:<user>``."""
    target = _target(board, identity)
    if kind == "release":
        name = _lock_in_namespace(board, _required(fields, "lock", "the lock's name"))
        with board.session() as (conn, tables):
            done = ops.force_release(conn, tables, name)
            if done is None:
                raise ConfigurationError(f"lock {name!r} is not held")
            controls.audit(conn, target, "release", lock_name=name, terminated=done.terminated)
        return done.as_json()
    schedule = Schedule(board.app)
    if kind == "rerun":
        return _rerun(board, target, schedule, fields)
    entry = _required(fields, "entry", "the entry")
    found = schedule.entry(entry)
    if kind == "backfill":
        return _backfill(board, target, schedule, found, fields)
    if kind == "resume":
        return _resume(board, target, schedule, found, fields)
    with board.session() as (conn, _):
        if kind == "pause":
            return controls.pause(conn, target, entry, fields.get("reason") or None)
        made = replay.trigger(board.app, conn, target, schedule, entry, send_now=False)
    if made["send"]:
        _deliver(board, found, made["lock_name"], [{"slot": made["slot"], "action": "send"}])
    return made


def _resume(
    board: Dashboard,
    target: controls.Target,
    schedule: Schedule,
    entry: Any,
    fields: dict[str, str],
) -> dict[str, Any]:
    """Resume ``entry``; with ``catch_up`` ticked, also send the slots the pause held back
    (the newest, at most the entry's catch-up limit), oldest first, as ``resume --catch-up``."""
    limit = (
        BeatSettings.from_app(board.app).entry_catch_up(entry)[1] if fields.get("catch_up") else 0
    )
    with board.session() as (conn, _):
        ended = controls.resume(conn, target, entry.name, catch_up=limit)
    if ended is None:
        raise ConfigurationError(f"{entry.name} is not paused")
    held = [{"slot": slot, "action": "send"} for slot in ended["caught_up"]]
    if held:
        _deliver(board, entry, schedule.lock_name(entry), held)
    return ended


def _rerun(
    board: Dashboard, target: controls.Target, schedule: Schedule, fields: dict[str, str]
) -> dict[str, Any]:
    reason = _required(fields, "reason", "a reason")
    entry, lock = replay.entry_of(schedule, _required(fields, "entry", "the entry"))
    slot = checked_slot("slot", _required(fields, "slot", "the slot"))
    with board.session() as (conn, _):
        previous = controls.reopen(conn, target, lock_name=lock, slot=slot, reason=reason)
    if previous is None:
        raise ConfigurationError(f"slot {slot} of {lock} has not succeeded: nothing to run again")
    _deliver(board, entry, lock, [{"slot": slot, "action": "send"}])
    return {"lock_name": lock, "slot": slot, "previous": previous}


def _backfill(
    board: Dashboard,
    target: controls.Target,
    schedule: Schedule,
    entry: Any,
    fields: dict[str, str],
) -> dict[str, Any]:
    """Audit the backfill now, then send its slots one at a time, each once the one
    before ended, in the background (as ``celery pglock backfill`` does in the foreground)."""
    found = _plan(board, schedule, entry, fields)
    lock = schedule.lock_name(entry)
    sending = [item["slot"] for item in found if item["action"] == "send"]
    with board.session() as (conn, _):
        controls.audit(
            conn,
            target,
            "backfill",
            entry=entry.name,
            lock_name=lock,
            range=[fields["from"], fields["to"]],
            sent=sending,
        )
    _deliver(board, entry, lock, found)
    return {"entry": entry.name, "lock_name": lock, "slots": found, "sending": sending}


def _deliver(board: Dashboard, entry: Any, lock: str, found: list[dict[str, Any]]) -> None:
    """Send these slots in the background as the CLI sends them in the foreground: one at
    a time, each once the one before ended, a slot skipped ``locked`` sent again."""
    thread = threading.Thread(
        target=_send_in_background,
        args=(board, entry, lock, found),
        name="pglock-web-send",
        daemon=True,
    )
    thread.start()


def _send_in_background(
    board: Dashboard, entry: Any, lock: str, found: list[dict[str, Any]]
) -> None:
    """Send confirmed slots one at a time, each once the one before ended; a failure is
    logged (nobody waits on this thread)."""
    try:
        with operator.connection(board.app, SEND_LABEL) as (conn, tables):
            delivery = replay.Delivery(board.app, conn, tables, entry, lock)
            replay.send_plan(found, delivery, BACKFILL_RATE)
    except PgLockError:
        logger.exception("the dashboard's sending of %s slots stopped", entry.name)
