"""The dashboard's pure parts: credentials, CSRF tokens, the Origin check, the strip and
the timeline's geometry, a schedule in words (no database, no server)."""

from __future__ import annotations

import base64
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery.schedules import crontab, schedule

from celery_pglock._config import web_credentials
from celery_pglock.errors import ConfigurationError
from celery_pglock.steering._history import MISSED, NO_RECORD, describe, strip
from celery_pglock.web import _svg as svg
from celery_pglock.web._app import _ago, _when
from celery_pglock.web.security import (
    ANONYMOUS,
    WRONG_CREDENTIALS,
    Credentials,
    Csrf,
    Identity,
    same_origin,
)

NOW = datetime(2026, 12, 2, 12, 0, 30, tzinfo=timezone.utc)


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def test_credentials_prove_a_user_or_a_token_and_nothing_else() -> None:
    """The configured user or token proves who asks; a header that proves nothing is told
    apart from no header; without credentials configured, any header is anonymous."""
    both = Credentials({"user": "ann", "password": "pw", "token": "t0k"})

    assert Identity("ann", can_act=True) == both.identify(basic("ann", "pw"))
    assert Identity("token", can_act=True) == both.identify("Bearer t0k")
    for wrong in (basic("ann", "no"), basic("bob", "pw"), "Bearer no", "Basic !!", "Digest x"):
        assert WRONG_CREDENTIALS == both.identify(wrong)
    for none in (None, ""):
        assert ANONYMOUS == both.identify(none)
    assert not Credentials({}).configured
    assert ANONYMOUS == Credentials({}).identify(basic("", ""))
    assert ANONYMOUS == Credentials({}).identify(basic("ann", "pw"))


def test_web_credentials_come_from_settings_else_the_environment() -> None:
    env = {"PGLOCK_WEB_USER": "ann", "PGLOCK_WEB_PASSWORD": "pw"}
    assert {"user": "ann", "password": "pw"} == web_credentials({}, env)
    assert {"token": "s"} == web_credentials({"pglock_web_token": "s"}, {})
    assert {} == web_credentials({}, {})
    with pytest.raises(ConfigurationError, match="go together"):
        web_credentials({"pglock_web_user": "ann"}, {})


def test_a_csrf_token_works_for_its_identity_until_it_expires() -> None:
    csrf = Csrf(b"k" * 32, ttl=60)
    ann, bob = Identity("ann", can_act=True), Identity("bob", can_act=True)
    token = csrf.token(ann, now=1000.0)

    assert csrf.check(ann, token, now=1059.0)
    assert not csrf.check(ann, token, now=1061.0)
    assert not csrf.check(bob, token, now=1001.0)
    assert not Csrf(b"x" * 32).check(ann, token, now=1001.0)
    for forged in (
        None,
        "",
        "1060",
        "1060.",
        "x.y",
        token.replace(token[-1], "0" if token[-1] != "0" else "1"),
    ):
        assert not csrf.check(ann, forged, now=1001.0)


def test_a_token_or_seal_with_characters_no_signature_has_is_refused_not_a_crash() -> None:
    """A forged CSRF token or notice seal with a non-ASCII character is simply wrong (it
    raised TypeError from the constant-time comparison: a 500)."""
    csrf = Csrf(b"k" * 32)
    ann = Identity("ann", can_act=True)

    assert not csrf.check(ann, "9999999999.\u00e9")
    assert csrf.sealed("pause: done", "\u00e9") is None
    assert "pause: done" == csrf.sealed("pause: done", csrf.seal("pause: done"))


def test_same_origin_wants_our_scheme_host_and_port() -> None:
    ours = "http://127.0.0.1:8555/"
    assert same_origin("http://127.0.0.1:8555", None, ours)
    assert same_origin(None, "http://127.0.0.1:8555/entry/tick", ours)
    assert not same_origin("http://127.0.0.1:9999", None, ours)
    assert not same_origin("http://evil.example", "http://127.0.0.1:8555/", ours)
    assert not same_origin(None, None, ours)
    assert not same_origin("null", None, ours)


def row(slot: str, state: str, created: datetime, **more: object) -> dict[str, object]:
    return {"slot": slot, "state": state, "created_at": created, "reason": None, **more}


def test_the_strip_keeps_slots_named_by_hand_and_marks_missed_ones() -> None:
    every = schedule(timedelta(seconds=10))
    rows = [
        row("2026-12-02T12:00:00Z", "succeeded", NOW),
        row("2026-12-02T11:59:40Z", "failed", NOW - timedelta(seconds=50)),
        row(
            "nightly-fix-1",
            "succeeded",
            NOW - timedelta(seconds=15),
            skips=1,
            skip_reasons={"done": 1},
        ),
        row("manual:2026-12-02T11:59:45.000000Z", "running", NOW - timedelta(seconds=45)),
    ]

    cells = strip(every, rows, NOW, align=True, size=8)

    assert [
        ("2026-12-02T11:59:30Z", NO_RECORD),  # older than the entry's oldest row
        ("2026-12-02T11:59:40Z", "failed"),
        ("manual:2026-12-02T11:59:45.000000Z", "running"),  # at its row's creation
        ("2026-12-02T11:59:50Z", MISSED),  # due, no row
        ("2026-12-02T12:00:00Z", "succeeded"),
        ("2026-12-02T12:00:10Z", MISSED),
        ("nightly-fix-1", "succeeded"),  # a slot named by hand
        ("2026-12-02T12:00:20Z", MISSED),
    ] == [(c.slot, c.state) for c in cells]
    title = svg.cell_title(cells[[c.slot for c in cells].index("nightly-fix-1")].as_json())
    assert "skipped duplicates: done x1" in title


def test_the_timeline_draws_a_bar_per_run_and_counts_overlaps() -> None:
    start = NOW - timedelta(minutes=10)
    runs = [
        row(
            "a",
            "succeeded",
            start,
            started_at=start,
            finished_at=start + timedelta(minutes=3),
            token=1,
            host="h",
            pid=1,
        ),
        row(
            "b",
            "failed",
            start,
            started_at=start + timedelta(minutes=2),
            finished_at=start + timedelta(minutes=4),
            token=2,
            host="h",
            pid=2,
        ),
        row(
            "c",
            "scheduled",
            start + timedelta(minutes=5),
            started_at=None,
            finished_at=None,
            token=None,
            host=None,
            pid=None,
        ),
    ]
    skips = [{"slot": "a", "at": start + timedelta(minutes=1), "reason": "locked"}]

    drawn = svg.timeline(runs, skips, [], since=NOW - timedelta(hours=1), until=NOW, now=NOW)

    assert ["a", "b"] == [bar["slot"] for bar in drawn["bars"]]
    assert 1 == drawn["overlaps"]
    assert ["skip"] == [mark["kind"] for mark in drawn["marks"]]
    assert 3 == len(drawn["labels"])
    assert all(svg.LABEL <= bar["x"] <= svg.LABEL + svg.WIDTH for bar in drawn["bars"])


def test_schedules_in_words() -> None:
    assert "every 5 min" == describe(schedule(timedelta(minutes=5)))
    assert "every 2.5 s" == describe(schedule(timedelta(seconds=2.5)))
    assert describe(crontab(minute="0", hour="3")).startswith("cron 0 3 * * * (")


def test_the_asgi_twin_serves_what_the_wsgi_app_serves() -> None:
    import asyncio  # noqa: PLC0415

    from asgiref.testing import ApplicationCommunicator  # noqa: PLC0415
    from celery import Celery  # noqa: PLC0415

    from celery_pglock.web import make_asgi_app  # noqa: PLC0415

    app = make_asgi_app(Celery("asgi-check", set_as_current=False))
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/static/style.css",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1")],
        "server": ("127.0.0.1", 8555),
        "scheme": "http",
        "http_version": "1.1",
        "root_path": "",
    }

    async def get() -> tuple[dict[str, Any], bytes]:
        talk = ApplicationCommunicator(app, scope)
        await talk.send_input({"type": "http.request", "body": b""})
        start = await talk.receive_output(5)
        body = b""
        while True:  # every body message, to the last: then the app's thread is done
            message = await talk.receive_output(5)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await talk.wait(5)
        return start, body

    start, body = asyncio.run(get())
    headers = {name.lower(): value for name, value in start["headers"]}  # type: ignore[attr-defined]
    assert 200 == start["status"]
    assert headers[b"content-security-policy"].startswith(b"default-src 'none'")
    assert b".s-succeeded" in body


def test_a_backfilled_old_slot_does_not_make_the_time_before_the_entry_missed() -> None:
    every = schedule(timedelta(seconds=10))
    rows = [
        row("2026-12-02T12:00:00Z", "succeeded", NOW - timedelta(seconds=30)),  # on time
        row("2026-12-02T11:59:00Z", "succeeded", NOW),  # backfilled just now
    ]

    states = {c.slot: c.state for c in strip(every, rows, NOW, align=True, size=16)}

    assert "succeeded" == states["2026-12-02T11:59:00Z"]
    assert NO_RECORD == states["2026-12-02T11:59:50Z"]  # before the ledger knew the entry
    assert MISSED == states["2026-12-02T12:00:10Z"]


def test_an_unreachable_server_is_told_without_its_dsn() -> None:
    from celery import Celery  # noqa: PLC0415
    from werkzeug.test import Client  # noqa: PLC0415

    from celery_pglock.web import make_app  # noqa: PLC0415

    app = Celery("no-db", set_as_current=False)
    app.conf.pglock_dsn = "postgresql://someone:s3cret@127.0.0.1:1/shop"
    app.conf.pglock_connect_timeout = 1
    client = Client(make_app(app))

    for path in ("/locks", "/api/locks"):
        response = client.get(path)
        text = response.get_data(as_text=True)
        assert 503 == response.status_code, text
        assert "PostgreSQL" in text
        for secret in ("s3cret", "someone", "shop", "postgresql://", "dbname="):
            assert secret not in text


def test_times_read_the_same_from_a_datetime_or_its_json_text() -> None:
    """The locks page renders the JSON view (ISO text): its times read as every page's."""
    moment = datetime(2026, 12, 2, 13, 5, 9, 120000, tzinfo=timezone.utc)

    assert "2026-12-02 13:05:09 UTC" == _when(moment) == _when(moment.isoformat())
    assert ("-", "not a time") == (_when(None), _when("not a time"))


def test_a_moment_ago_reads_just_now_even_a_little_in_the_future() -> None:
    """An age under a second either side reads 'just now' (never '-0 s ago'): a run may end
    while the page reads, and PostgreSQL's clock may be a little ahead of the page's."""
    assert ["just now"] * 4 == [_ago(s) for s in (0.0, 0.4, -0.3, -0.999)]
    assert ("1 s ago", "45 s ago", "1.5 min ago", "2.0 d ago") == (
        _ago(1.2),
        _ago(45),
        _ago(90),
        _ago(2 * 86400),
    )
    assert "-" == _ago(None)
    ahead = _ago(-5.0)
    assert "ago" not in ahead
    assert "-" not in ahead
    assert "5 s ahead" in ahead


def post_action(kind: str, fields: dict[str, str]) -> tuple[int, str]:
    """POST a confirmed (or reviewed) action as a user who may act, with its CSRF token and
    our Origin, to the dashboard of an app with one beat entry ``tick`` and no database."""
    from celery import Celery  # noqa: PLC0415
    from werkzeug.test import Client  # noqa: PLC0415

    from celery_pglock.web import make_app  # noqa: PLC0415

    app = Celery("actions", set_as_current=False)
    app.conf.update(
        pglock_dsn="postgresql://nobody@127.0.0.1:1/none",
        pglock_connect_timeout=1,
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
        beat_schedule={"tick": {"task": "actions.tick", "schedule": 3.0}},
    )
    ann = Identity("ann", can_read=True, can_act=True)
    board = make_app(app, identify=lambda request: ann)
    form = {**fields, "csrf": board.csrf.token(ann)}
    response = Client(board).post(
        f"/action/{kind}", data=form, headers={"Origin": "http://localhost"}
    )
    return response.status_code, response.get_data(as_text=True)


def test_a_backfill_time_without_a_utc_offset_is_refused_as_the_cli_refuses_it() -> None:
    """A time without Z or +HH:MM is ambiguous: refused with the fix, never taken as UTC."""
    fields = {"entry": "tick", "from": "2026-12-01T00:00:00", "to": "2026-12-01T01:00:00Z"}

    status, page = post_action("backfill", {**fields, "step": "review"})

    assert (400, True) == (status, "no UTC offset: add Z or +HH:MM" in page), page


def refused(conf: dict[str, str], headers: dict[str, str]) -> tuple[int, str, str | None]:
    """A confirmed pause POSTed to the standalone dashboard (``conf``: its credentials)
    with ``headers``: the status, the page, the ``WWW-Authenticate`` challenge."""
    from celery import Celery  # noqa: PLC0415
    from werkzeug.test import Client  # noqa: PLC0415

    from celery_pglock.web import make_app  # noqa: PLC0415

    app = Celery("refusals", set_as_current=False)
    app.conf.update(pglock_dsn="postgresql://nobody@127.0.0.1:1/none", **conf)
    form = {"entry": "tick", "step": "confirm"}
    response = Client(make_app(app)).post(
        "/action/pause", data=form, headers={"Origin": "http://localhost", **headers}
    )
    challenge = response.headers.get("WWW-Authenticate")
    return response.status_code, response.get_data(as_text=True), challenge


def test_a_wrong_password_is_told_apart_from_none_sent_and_none_configured() -> None:
    """Credentials sent that prove nothing: 'Wrong user name, password or token.' (401,
    challenged); none sent: asked for; none configured: how to set them (no challenge)."""
    conf = {"pglock_web_user": "ann", "pglock_web_password": "pw"}
    asking = "Actions need credentials (pglock_web_user and pglock_web_password"
    wrong = "Wrong user name, password or token."

    status, page, challenge = refused(conf, {"Authorization": basic("ann", "no")})
    assert (401, True, False) == (status, wrong in page, asking in page), page
    assert challenge is not None
    assert challenge.startswith("Basic ")
    status, page, challenge = refused(conf, {})
    assert (401, False, True) == (status, wrong in page, asking in page), page
    assert challenge is not None
    status, page, challenge = refused({}, {"Authorization": basic("ann", "pw")})
    assert (401, False, True, None) == (status, wrong in page, asking in page, challenge), page


def test_an_unreachable_server_is_said_and_the_page_reloads_itself_until_it_answers() -> None:
    """While PostgreSQL is unreachable a page says so, that it works again once it answers,
    and reloads itself (a meta refresh, no script); an action says so without reloading
    (a reload of a POST's page would GET the action)."""
    from celery import Celery  # noqa: PLC0415
    from werkzeug.test import Client  # noqa: PLC0415

    from celery_pglock.web import make_app  # noqa: PLC0415

    app = Celery("no-db", set_as_current=False)
    app.conf.pglock_dsn = "postgresql://someone:s3cret@127.0.0.1:1/shop"
    app.conf.pglock_connect_timeout = 1

    response = Client(make_app(app)).get("/locks")
    page = response.get_data(as_text=True)

    assert 503 == response.status_code, page
    assert "<h1>PostgreSQL is unreachable</h1>" in page
    assert "Not done" not in page
    assert "works again as soon as it answers" in page
    assert '<meta http-equiv="refresh" content="10">' in page
    assert "10" == response.headers.get("Retry-After")
    status, page = post_action("pause", {"entry": "tick", "step": "confirm"})
    assert (503, True) == (status, "<h1>PostgreSQL is unreachable</h1>" in page), page
    assert 'http-equiv="refresh"' not in page
