"""The web dashboard against real processes, in a real browser: a worker and two
PgLockScheduler beats (a leader and a standby) serving a 3-s entry ``tick`` and an hourly
entry named like a script, ``celery -A … pglock web`` (waitress, loopback) with a
basic-auth user, and headless Chromium driven by Selenium (Debian's ``chromium`` and
``chromium-driver``). The tests read the DOM, act through the pages' own forms, and check
what changed with ``celery pglock`` and the ledger. One lab and one browser for the module
(one xdist group: ``tests/fixtures/sharing.py`` groups module-scoped fixtures).

With ``PGLOCK_SCREENSHOTS=<folder>`` (``make screenshots``) the pages' screenshots are
written there (``docs/images``), else under the test's temporary folder.
"""

from __future__ import annotations

import base64
import html
import json
import re
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from psycopg.conninfo import make_conninfo
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By

from celery_pglock._messages import ENTRY_HEADER, SLOT_HEADER
from tests.acceptance.beat_support import APP, prepare_schema
from tests.acceptance.browser import acting_as, browser, click_through, free_port, screenshot
from tests.acceptance.controls_lab import DEADLINE, PASSWORD, ROOT, Lab, serving, utcnow
from tests.apps.harness import Gate, app_env, configure_broker_client
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

EVIL = "<script>alert(1)</script>"
WEB_USER = "ann"
WEB_PASSWORD = "d4shb0ard-pw"  # noqa: S105 - the test's own basic-auth password
HTTP_TIMEOUT = 10.0
__all__ = ["browser"]  # the module's browser (tests/acceptance/browser.py)


@dataclass
class Dash:
    lab: Lab
    url: str

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        request = urllib.request.Request(self.url + path, headers=headers or {})  # noqa: S310
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:  # noqa: S310 - loopback
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def post(self, path: str, form: dict[str, str], headers: dict[str, str]) -> int:
        data = urllib.parse.urlencode(form).encode()
        request = urllib.request.Request(  # noqa: S310 - our loopback URL
            self.url + path, data=data, headers=headers, method="POST"
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:  # noqa: S310 - loopback
                return int(response.status)
        except urllib.error.HTTPError as exc:
            return exc.code

    def act(self, kind: str, fields: dict[str, str], step: str) -> tuple[int, str]:
        """Post an action's form as the web user, with a fresh token and our Origin: the
        review's page, a refusal, or (a confirmed action redirects, 303, followed with a
        GET) the page that tells the outcome."""
        auth = {"Authorization": basic(WEB_USER, WEB_PASSWORD)}
        page = self.get("/entry/tick", headers=auth)[1]
        token = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]
        data = urllib.parse.urlencode({**fields, "csrf": token, "step": step}).encode()
        request = urllib.request.Request(  # noqa: S310 - our loopback URL
            f"{self.url}/action/{kind}",
            data=data,
            headers={**auth, "Origin": self.url},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT) as response:  # noqa: S310 - loopback
                return response.status, html.unescape(response.read().decode())
        except urllib.error.HTTPError as exc:
            return exc.code, html.unescape(exc.read().decode())

    def api(self, path: str) -> Any:
        status, text = self.get(path)
        assert 200 == status, text
        assert PASSWORD not in text
        assert WEB_PASSWORD not in text
        return json.loads(text)

    def answers(self) -> bool:
        try:
            return self.get("/api/audit")[0] == 200
        except OSError:
            return False


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.fixture(scope="module")
def dash(pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dash]:
    schema = f"t_dash_{uuid.uuid4().hex[:8]}"
    prepare_schema(pg_dsn, schema)
    env = app_env(
        pg_dsn=make_conninfo(pg_dsn, password=PASSWORD),
        schema=schema,
        broker_url=redis_url,
        TEST_BEAT_EVERY="3",
        TEST_BEAT_LEADER="1",
        TEST_BEAT_MORE=json.dumps({EVIL: 3600}),
        PGLOCK_WEB_USER=WEB_USER,
        PGLOCK_WEB_PASSWORD=WEB_PASSWORD,
    )
    procs = Procs(tmp_path_factory.mktemp("dashboard"), cwd=ROOT)
    port = free_port()
    for lab in serving(Lab(env, pg_dsn, schema), procs, ["-c", "2"], beats=2):
        web = procs.celery(APP, "pglock", "web", "--bind", f"127.0.0.1:{port}", env=env, name="web")
        board = Dash(lab, f"http://127.0.0.1:{port}")
        wait_until(board.answers, timeout=DEADLINE, message="the dashboard to answer")
        assert "loopback only" in web.log_path.read_text()
        yield board


def tooltip(element: Any) -> str:
    return str(element.find_element(By.TAG_NAME, "title").get_attribute("textContent"))


def test_overview_strip_shows_a_skipped_duplicate_with_its_reason(dash: Dash, browser: Any) -> None:
    ran = dash.lab.executed()[-1]
    configure_broker_client(dash.lab.env)
    from tests.apps import testapp  # noqa: PLC0415 - configured just above

    testapp.app.send_task("testapp.tick", headers={SLOT_HEADER: ran, ENTRY_HEADER: "tick"})
    wait_until(
        lambda: dash.lab.rows("SELECT * FROM {} WHERE slot = %(slot)s", "pglock_skips", slot=ran),
        timeout=DEADLINE,
        message="the duplicate to be skipped",
    )

    browser.get(dash.url + "/")

    row = browser.find_element(By.CSS_SELECTOR, 'tr[data-entry="tick"]')
    cell = row.find_element(By.CSS_SELECTOR, f'rect[data-slot="{ran}"]')
    assert "succeeded" == cell.get_attribute("data-state")
    assert "skipped duplicates: done x1" in tooltip(cell)
    beat = browser.find_element(By.ID, "beat").text
    assert "Leader:" in beat
    assert ", since " in beat  # the election's time, from the leader's holder row
    assert "Standbys: 1" in beat


def test_entry_timeline_draws_one_bar_per_attempt(dash: Dash, browser: Any) -> None:
    browser.get(dash.url + "/entry/tick?hours=1")

    bars = browser.find_elements(By.CSS_SELECTOR, "#timeline rect.bar")
    drawn = [bar.get_attribute("data-slot") for bar in bars]
    rows = dash.lab.rows(
        "SELECT slot, finished_at FROM {} WHERE entry = 'tick' AND started_at IS NOT NULL",
        "pglock_runs",
    )
    finished = {row["slot"] for row in rows if row["finished_at"] is not None}
    started = {row["slot"] for row in rows}
    assert len(drawn) == len(set(drawn))  # one bar per attempt: the ledger keeps the last
    assert set(drawn) <= started
    assert len(finished - set(drawn)) <= 1  # a run may end between the page and this query
    assert len(drawn) >= 2


def test_pause_pressed_in_the_browser_pauses_the_entry_audited_as_the_web_user(
    dash: Dash, browser: Any, tmp_path: Path
) -> None:
    acting_as(browser, basic(WEB_USER, WEB_PASSWORD))
    try:
        browser.get(dash.url + "/entry/tick")
        browser.find_element(By.ID, "pause-reason").send_keys("disk full <b>now</b>")
        click_through(browser, browser.find_element(By.ID, "pause"))
        assert "Confirm: pause" in browser.find_element(By.TAG_NAME, "h1").text
        screenshot(browser, "confirm", tmp_path)
        click_through(browser, browser.find_element(By.ID, "confirm"))
        notice = browser.find_element(By.ID, "done").text
        assert notice.startswith("pause: done at "), notice
        assert f"paused by web:{WEB_USER}: disk full <b>now</b>" in notice
        assert browser.current_url.startswith(dash.url + "/entry/tick?")  # redirected there
    finally:
        acting_as(browser, None)

    code, out = dash.lab.cli("status")
    assert 0 == code, out
    assert "PAUSED ENTRIES (1)" in out
    [leader] = [line for line in out.splitlines() if line.lstrip().startswith("leader ")]
    assert re.search(r" \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ \(", leader), out  # since when
    assert "disk full <b>now</b>" in out
    [row] = dash.lab.rows("SELECT * FROM {} WHERE action = 'pause'", "pglock_audit")
    assert (f"web:{WEB_USER}", "tick") == (row["actor"], row["entry"])
    browser.get(dash.url + "/")
    badge = browser.find_element(By.CSS_SELECTOR, 'tr[data-entry="tick"] .badge.paused').text
    assert f"paused by web:{WEB_USER}: disk full <b>now</b>" == badge
    assert 0 == dash.lab.cli("resume", "tick")[0]


def test_resume_with_catch_up_ticked_sends_the_slots_the_pause_held_back(dash: Dash) -> None:
    """The dashboard's resume, "also send the slots held back" ticked, sends them oldest
    first, each once, as `pglock resume --catch-up` does (it could not, before)."""
    lab = dash.lab
    status, page = dash.act("pause", {"entry": "tick", "reason": "catch-up"}, "confirm")
    assert 200 == status, page
    paused = utcnow()

    def held() -> list[str]:
        return [r["slot"] for r in lab.runs("paused") if r["scheduled_at"] > paused]

    slots = wait_until(lambda: len(held()) >= 2 and held(), timeout=DEADLINE, message="held")
    status, page = dash.act("resume", {"entry": "tick", "catch_up": "1"}, "confirm")

    assert 200 == status, page
    wait_until(lambda: set(slots) <= set(lab.executed()), timeout=DEADLINE, message="caught up")
    query = "SELECT * FROM {} WHERE action = 'resume' AND actor = %(actor)s"
    [row] = lab.rows(query, "pglock_audit", actor=f"web:{WEB_USER}")
    assert f"web:{WEB_USER}" == row["actor"]
    assert set(slots) <= set(row["detail"]["caught_up"])
    assert [1] * len(slots) == [lab.executed().count(slot) for slot in slots]


def test_actions_without_the_csrf_token_or_credentials_are_refused_and_change_nothing(
    dash: Dash,
) -> None:
    origin = {"Origin": dash.url}
    auth = {"Authorization": basic(WEB_USER, WEB_PASSWORD)}
    form = {"entry": "tick", "reason": "x", "step": "confirm"}
    _status, page = dash.get("/entry/tick", headers=auth)
    token = page.split('name="csrf" value="', 1)[1].split('"', 1)[0]

    assert 401 == dash.post("/action/pause", {**form, "csrf": token}, origin)
    assert 401 == dash.post(
        "/action/pause", {**form, "csrf": token}, {**origin, "Authorization": basic("ann", "no")}
    )
    assert 403 == dash.post("/action/pause", form, {**origin, **auth})
    assert 403 == dash.post("/action/pause", {**form, "csrf": "1.forged"}, {**origin, **auth})
    assert 403 == dash.post("/action/pause", {**form, "csrf": token}, auth)  # no Origin
    evil = {"Origin": "http://evil.example", **auth}
    assert 403 == dash.post("/action/pause", {**form, "csrf": token}, evil)
    assert 405 == dash.get("/action/pause", headers=auth)[0]
    assert [] == dash.lab.rows("SELECT * FROM {} WHERE entry = 'tick'", "pglock_pauses")


def test_a_script_named_entry_renders_as_text(dash: Dash, browser: Any) -> None:
    browser.get(dash.url + "/")

    row = browser.find_element(By.CSS_SELECTOR, "tr[data-entry]:not([data-entry=tick])")
    assert EVIL == row.get_attribute("data-entry")
    assert EVIL in row.text
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert  # noqa: B018 - reading it is the check
    status, html = dash.get("/entry/" + urllib.parse.quote(EVIL, safe=""))
    assert 200 == status
    assert EVIL not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    headers = urllib.request.urlopen(dash.url + "/", timeout=HTTP_TIMEOUT).headers  # noqa: S310
    assert headers["Content-Security-Policy"].startswith("default-src 'none'")
    for path in ("/", "/locks", "/audit", "/entry/tick", "/api/overview", "/api/locks"):
        text = dash.get(path)[1]
        assert PASSWORD not in text
        assert WEB_PASSWORD not in text


def test_json_endpoints_answer_as_the_cli_json(dash: Dash) -> None:
    slot = dash.lab.executed()[0]

    def same_slot() -> bool:
        code, out = dash.lab.cli("why", "tick", slot, "--json")
        return 0 == code and json.loads(out) == dash.api(f"/api/slot?name=tick&slot={slot}")

    def same_status() -> bool:
        code, out = dash.lab.cli("status", "--json")
        return 0 == code and json.loads(out) == dash.api("/api/locks")

    # Both answer for one moment of a ledger that changes every 3 s: asked again until
    # the two answers fall between two runs.
    wait_until(same_slot, timeout=DEADLINE, message="why --json == /api/slot")
    wait_until(same_status, timeout=DEADLINE, message="status --json == /api/locks")
    overview = dash.api("/api/overview")
    assert {"tick", EVIL} == {entry["entry"] for entry in overview["entries"]}
    assert len(overview["entries"][0]["strip"]) == 48


def test_a_slot_named_by_hand_is_on_the_strip_and_the_timeline(dash: Dash, browser: Any) -> None:
    slot = f"nightly-fix-{uuid.uuid4().hex[:6]}"
    code, out = dash.lab.cli("trigger", "tick", "--slot", slot)
    assert 0 == code, out
    wait_until(lambda: slot in dash.lab.executed(), timeout=DEADLINE, message="the run by hand")

    browser.get(dash.url + "/")
    cell = browser.find_element(By.CSS_SELECTOR, f'tr[data-entry="tick"] rect[data-slot="{slot}"]')
    assert "succeeded" == cell.get_attribute("data-state")
    browser.get(dash.url + "/entry/tick?hours=1")
    assert 1 == len(
        browser.find_elements(By.CSS_SELECTOR, f'#timeline rect.bar[data-slot="{slot}"]')
    )


def test_trigger_rerun_and_backfill_through_the_forms_as_the_web_user(
    dash: Dash, browser: Any, tmp_path: Path
) -> None:
    lab = dash.lab
    status, page = dash.act("trigger", {"entry": "tick"}, "review")
    assert (200, True) == (status, "Confirm: trigger" in page)
    status, page = dash.act("trigger", {"entry": "tick"}, "confirm")
    assert 200 == status, page
    [slot] = re.findall(r'id="done">trigger: done at [^<]* slot (manual:\S+) of tick', page)
    wait_until(lambda: slot in lab.executed(), timeout=DEADLINE, message="the triggered run")

    status, page = dash.act("rerun", {"entry": "tick", "slot": slot, "reason": ""}, "confirm")
    assert (400, True) == (status, "a reason is required" in page)
    status, page = dash.act("rerun", {"entry": "tick", "slot": slot, "reason": "fix"}, "confirm")
    assert 200 == status, page
    wait_until(lambda: lab.executed().count(slot) == 2, timeout=DEADLINE, message="the rerun")

    start = datetime.now(timezone.utc) - timedelta(minutes=10)
    window = {"entry": "tick", "from": f"{start:%Y-%m-%dT%H:%M:%SZ}"}
    window["to"] = f"{start + timedelta(seconds=5):%Y-%m-%dT%H:%M:%SZ}"
    status, page = dash.act("backfill", window, "review")
    assert 200 == status, page
    planned = re.findall(r"<tr><td>([0-9T:Z-]+)</td><td>send</td><td>never ran</td></tr>", page)
    assert len(planned) in (1, 2)  # a 3-s entry has one or two slots in 5 s
    assert set(planned).isdisjoint(lab.executed())  # the dry run sent nothing
    status, page = dash.act("backfill", window, "confirm")
    assert 200 == status, page
    wait_until(
        lambda: set(planned) <= set(lab.executed()), timeout=DEADLINE, message="the backfill"
    )
    [audit] = lab.rows("SELECT * FROM {} WHERE action = 'backfill'", "pglock_audit")
    started = [run["started_at"] for run in lab.runs() if run["slot"] in planned]
    assert all(audit["at"] < moment for moment in started)  # audited before it sent (as the CLI)
    status, page = dash.act("release", {"lock": "elsewhere:lock"}, "review")
    assert (400, True) == (status, "outside this app's namespace" in page)
    browser.get(f"{dash.url}/slot?" + urllib.parse.urlencode({"name": "tick", "slot": slot}))
    assert slot in browser.find_element(By.TAG_NAME, "h1").text
    audited = browser.find_element(By.CSS_SELECTOR, "table.audit").text
    assert "rerun" in audited
    assert f"web:{WEB_USER}" in audited
    screenshot(browser, "slot", tmp_path)
    actors = {
        row["action"]: row["actor"]
        for row in lab.rows("SELECT action, actor FROM {} ORDER BY id", "pglock_audit")
    }
    assert {"trigger", "rerun", "backfill"} <= set(actors)
    assert {f"web:{WEB_USER}"} == {actors[name] for name in ("trigger", "rerun", "backfill")}
    browser.get(dash.url + "/")  # the pictures of docs/dashboard.md: the most history
    screenshot(browser, "overview", tmp_path)
    browser.get(dash.url + "/entry/tick?hours=1")
    screenshot(browser, "entry", tmp_path)
    browser.get(dash.url + "/audit")
    actions = [
        td.text for td in browser.find_elements(By.CSS_SELECTOR, "table.audit td:nth-child(2)")
    ]
    assert {"trigger", "rerun", "backfill"} <= set(actions)
    screenshot(browser, "audit", tmp_path)


def held_locks(dash: Dash) -> set[str]:
    code, out = dash.lab.cli("status", "--json")
    assert 0 == code, out
    return {lock["lock"] for lock in json.loads(out)["locks"] if lock["holder"]}


def test_a_held_lock_released_from_the_locks_page_as_the_web_user(
    dash: Dash, browser: Any, tmp_path: Path
) -> None:
    lock = f"{dash.lab.schema}:testapp.gated"
    configure_broker_client(dash.lab.env)
    from tests.apps import testapp  # noqa: PLC0415 - configured just above

    with Gate(dash.lab.admin_dsn) as gate:
        testapp.gated.apply_async((gate.id,))  # holds its lock until the gate opens
        wait_until(lambda: lock in held_locks(dash), timeout=DEADLINE, message="the lock held")
        acting_as(browser, basic(WEB_USER, WEB_PASSWORD))
        try:
            browser.get(dash.url + "/locks")
            row = browser.find_element(
                By.XPATH, f"//table[@id='locks']//tr[td[1][normalize-space()='{lock}']]"
            )
            assert "HELD 1 of 1" in row.text
            screenshot(browser, "locks", tmp_path)
            click_through(browser, row.find_element(By.TAG_NAME, "button"))
            assert "Confirm: release" in browser.find_element(By.TAG_NAME, "h1").text
            click_through(browser, browser.find_element(By.ID, "confirm"))
            notice = browser.find_element(By.ID, "done").text
            assert notice.startswith("release: done at "), notice
            assert f"lock {lock} released by web:{WEB_USER}" in notice
            assert browser.current_url.startswith(dash.url + "/locks?")  # redirected there
        finally:
            acting_as(browser, None)
        assert lock not in held_locks(dash)

    [row] = dash.lab.rows(
        "SELECT * FROM {} WHERE action = 'release' AND lock_name = %(lock)s",
        "pglock_audit",
        lock=lock,
    )
    assert f"web:{WEB_USER}" == row["actor"]


def test_a_stored_entry_is_created_edited_and_deleted_in_the_browser(
    dash: Dash, browser: Any, tmp_path: Path
) -> None:
    """The stored entries page's form: add an entry (reviewed with its next five slots),
    change its schedule, remove it; each confirmed, audited as the web user with before
    and after, and what `celery pglock entries list` then shows."""
    acting_as(browser, basic(WEB_USER, WEB_PASSWORD))
    try:
        browser.get(dash.url + "/stored")
        browser.find_element(By.ID, "entry-name").send_keys("browser-made")
        browser.find_element(By.ID, "entry-task").send_keys("testapp.tick")
        browser.find_element(By.ID, "entry-cron").send_keys("0 9 * * *")
        browser.find_element(By.ID, "entry-tz").send_keys("Europe/Paris")
        click_through(browser, browser.find_element(By.ID, "entry-review"))
        assert "Confirm: entry_add" in browser.find_element(By.TAG_NAME, "h1").text
        assert 5 == len(browser.find_elements(By.CSS_SELECTOR, "#next tbody tr"))
        screenshot(browser, "entry-confirm", tmp_path)
        click_through(browser, browser.find_element(By.ID, "confirm"))
        assert (
            f"entry browser-made added by web:{WEB_USER}"
            in browser.find_element(By.ID, "done").text
        )

        browser.get(dash.url + "/stored?edit=browser-made")
        cron = browser.find_element(By.ID, "entry-cron")
        cron.clear()
        cron.send_keys("30 9 * * *")
        click_through(browser, browser.find_element(By.ID, "entry-review"))
        click_through(browser, browser.find_element(By.ID, "confirm"))
        assert "changed by" in browser.find_element(By.ID, "done").text

        listed = json.loads(dash.lab.cli("entries", "list", "--json")[1])
        assert [("browser-made", "30 9 * * *", True)] == [
            (e["name"], e["schedule"]["cron"], e["enabled"]) for e in listed
        ]
        row = browser.find_element(By.CSS_SELECTOR, 'tr[data-entry="browser-made"]')
        click_through(browser, row.find_element(By.CSS_SELECTOR, "button.remove"))
        click_through(browser, browser.find_element(By.ID, "confirm"))
        assert "removed by" in browser.find_element(By.ID, "done").text
    finally:
        acting_as(browser, None)

    assert [] == json.loads(dash.lab.cli("entries", "list", "--json")[1])
    trail = dash.lab.rows(
        "SELECT action, actor, detail FROM {} WHERE entry = 'browser-made' ORDER BY id",
        "pglock_audit",
    )
    assert ["entry_add", "entry_edit", "entry_remove"] == [row["action"] for row in trail]
    assert {f"web:{WEB_USER}"} == {row["actor"] for row in trail}
    assert "0 9 * * *" == trail[1]["detail"]["before"]["schedule"]["cron"]


def test_the_overview_warns_of_a_rogue_scheduler(dash: Dash, browser: Any) -> None:
    configure_broker_client(dash.lab.env)
    from tests.apps import testapp  # noqa: PLC0415 - configured just above

    testapp.app.send_task("testapp.tick")  # no slot: what a stock beat beside ours sends

    def warned() -> str:
        browser.get(dash.url + "/")
        found = browser.find_elements(By.ID, "rogue")
        return str(found[0].text) if found else ""

    warning = wait_until(
        warned, timeout=DEADLINE, interval=0.5, message="the rogue-scheduler warning"
    )
    assert "Rogue scheduler" in warning
    assert "testapp.tick" in warning
