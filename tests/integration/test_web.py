"""The dashboard's actions against a real PostgreSQL, through the WSGI application
(Werkzeug's test client, no server, no worker): what a confirmed action answers and what
the page it leads to shows."""

from __future__ import annotations

import json
import os
import re
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql
from werkzeug.test import Client

from celery_pglock import ops
from celery_pglock._config import Settings, app_settings
from celery_pglock._locks import acquire, release
from celery_pglock._protocol import Lease
from celery_pglock.errors import LockLost
from celery_pglock.store._connections import HOSTNAME
from celery_pglock.web import Dashboard, make_app
from celery_pglock.web.security import Identity
from tests.integration.locking import claim, open_database

pytestmark = pytest.mark.integration

ANN = Identity("ann", can_read=True, can_act=True)
ORIGIN = {"Origin": "http://localhost"}


def dashboard(pg_dsn: str, schema: str) -> tuple[Dashboard, Client]:
    """The dashboard of an app with one beat entry ``tick``, acting as ``web:ann``."""
    app = Celery("webapp", set_as_current=False)
    app.conf.update(
        pglock_dsn=pg_dsn,
        pglock_schema=schema,
        pglock_namespace=schema,
        beat_scheduler="celery_pglock.beat:PgLockScheduler",
        beat_schedule={"tick": {"task": "webapp.tick", "schedule": 3600.0}},
    )
    ops.migrate(app_settings(app))
    board = make_app(app, identify=lambda request: ANN)
    return board, Client(board)


def notice(page: str) -> str | None:
    found = re.search(r'<p class="notice" id="done">(.*?)</p>', page, re.DOTALL)
    return found.group(1) if found else None


def audited(pg_dsn: str, schema: str, action: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        query = sql.SQL("SELECT count(*) FROM {} WHERE action = %s").format(
            sql.Identifier(schema, "pglock_audit")
        )
        row: Any = conn.execute(query, (action,)).fetchone()
        return int(row[0])


def test_a_confirmed_action_redirects_to_its_page_which_tells_the_outcome(
    pg_dsn: str, pglock_schema: str
) -> None:
    """A confirmed pause answers 303 See Other to the entry's page, which tells what was
    done in a sentence, not JSON; loading that page again does not pause again."""
    board, client = dashboard(pg_dsn, pglock_schema)
    form = {"entry": "tick", "reason": "disk <b>full</b>", "step": "confirm"}

    response = client.post(
        "/action/pause", data={**form, "csrf": board.csrf.token(ANN)}, headers=ORIGIN
    )

    assert 303 == response.status_code, response.get_data(as_text=True)
    location = response.headers["Location"]
    assert location.startswith("/entry/tick?")
    for _ in range(2):  # the page, and its reload
        page = client.get(location)
        text = page.get_data(as_text=True)
        assert 200 == page.status_code, text
        told = notice(text)
        assert told is not None, text
        assert told.startswith("pause: done at ")
        assert "paused by web:ann: disk &lt;b&gt;full&lt;/b&gt;" in told
        assert '"paused_by"' not in text
    assert 1 == audited(pg_dsn, pglock_schema, "pause")


def test_a_notice_not_made_by_the_dashboard_is_not_shown(pg_dsn: str, pglock_schema: str) -> None:
    """A link carrying a notice of its own making (no or a wrong signature) shows none: a
    page never claims an action was done when the dashboard did not do it."""
    board, client = dashboard(pg_dsn, pglock_schema)
    made = client.post(
        "/action/pause",
        data={"entry": "tick", "step": "confirm", "csrf": board.csrf.token(ANN)},
        headers=ORIGIN,
    ).headers["Location"]
    forged = re.sub(r"sig=[0-9a-f]+", "sig=" + "0" * 64, made)

    for location in (forged, "/entry/tick?done=release%3A+done", "/locks?done=x&sig=y"):
        page = client.get(location)
        assert (200, None) == (page.status_code, notice(page.get_data(as_text=True)))
    assert notice(client.get(made).get_data(as_text=True)) is not None


def post(board: Dashboard, client: Client, kind: str, step: str, **form: str) -> Any:
    data = {**form, "step": step, "csrf": board.csrf.token(ANN)}
    return client.post(f"/action/{kind}", data=data, headers=ORIGIN)


def test_a_stored_entry_is_added_changed_and_removed_from_the_dashboard_audited(
    pg_dsn: str, pglock_schema: str
) -> None:
    """Add, change and remove a stored entry through the forms: each reviewed first (its
    next five slots, in its timezone), then confirmed; audited as web:ann; a bad field is
    refused naming it, and nothing is stored."""
    board, client = dashboard(pg_dsn, pglock_schema)
    form = {"name": "report", "task": "webapp.tick", "cron": "30 2 * * *", "tz": "Europe/Paris"}
    form |= {"force": "on"}  # the test's app imports no task

    review = post(board, client, "entry_add", "review", **form, enabled="on").get_data(as_text=True)

    assert "Confirm: entry_add" in review
    assert 5 == review.count("T01:30:00Z") + review.count("T00:30:00Z")  # 02:30 Paris
    bad = post(board, client, "entry_add", "review", **{**form, "cron": "99 * * * *"})
    assert 400 == bad.status_code
    assert "cron: &#39;99 * * * *&#39; is not" in bad.get_data(as_text=True)
    added = post(board, client, "entry_add", "confirm", **form, enabled="on")
    assert 303 == added.status_code
    assert "entry report added by web:ann" in client.get(added.headers["Location"]).get_data(
        as_text=True
    )

    changed = post(board, client, "entry_edit", "confirm", name="report", every="5m", force="on")
    assert 303 == changed.status_code
    page = client.get("/stored").get_data(as_text=True)
    assert '{"every": 300.0}' in page.replace("&#34;", '"')
    removed = post(board, client, "entry_remove", "confirm", name="report")
    assert 303 == removed.status_code
    assert "none stored" in client.get("/stored").get_data(as_text=True)
    for action in ("entry_add", "entry_edit", "entry_remove"):
        assert 1 == audited(pg_dsn, pglock_schema, action)


def test_a_stored_entry_s_hostile_arguments_stay_inside_the_edit_form(
    pg_dsn: str, pglock_schema: str
) -> None:
    """Arguments holding quotes and markup are shown in the edit form as text: they never
    end the attribute they are in (no markup of theirs reaches the page)."""
    board, client = dashboard(pg_dsn, pglock_schema)
    hostile = '" autofocus onfocus="alert(1)'
    form = {"name": "evil", "task": "webapp.tick", "every": "1h", "force": "on"}
    args = json.dumps([hostile, "</script><script>alert(2)</script>"])
    form |= {"args": args, "enabled": "on"}
    assert 303 == post(board, client, "entry_add", "confirm", **form).status_code

    page = client.get("/stored?edit=evil").get_data(as_text=True)

    assert 'onfocus="alert(1)' not in page
    assert "<script>alert(2)" not in page
    assert "autofocus onfocus=&#34;alert(1)" in page.replace("\\&#34;", "&#34;")


def test_a_holder_on_rows_shows_on_the_locks_page_and_is_released_from_it(
    pg_dsn: str, pglock_schema: str
) -> None:
    """A lock held on rows (behind a transaction pooler) shows on the locks page as an
    advisory one does, said to be on rows; *Release* confirms that its row is deleted,
    and after it the lock is free."""
    board, client = dashboard(pg_dsn, pglock_schema)
    name = f"{pglock_schema}:webapp.tick"
    settings = Settings(dsn=pg_dsn, schema=pglock_schema, lock_backend="rows")
    with open_database(settings) as db:
        lease = acquire(db, claim(name, None, "t-rows"), "session", 30.0)
        assert isinstance(lease, Lease)

        page = client.get("/locks").get_data(as_text=True)
        assert f"{HOSTNAME} pid {os.getpid()} (on rows)" in page
        form = {"lock": name, "csrf": board.csrf.token(ANN)}
        review = client.post("/action/release", data={**form, "step": "review"}, headers=ORIGIN)
        assert "a lock on rows: its row is deleted" in review.get_data(as_text=True)
        done = client.post("/action/release", data={**form, "step": "confirm"}, headers=ORIGIN)

        assert 303 == done.status_code, done.get_data(as_text=True)
        assert f"{HOSTNAME} pid {os.getpid()} (on rows)" not in client.get("/locks").get_data(
            as_text=True
        )
        with pytest.raises(LockLost):
            lease.check()
        release(db, lease, "succeeded")
