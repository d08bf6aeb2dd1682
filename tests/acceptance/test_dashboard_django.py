"""The dashboard mounted in a Django project (``path("pglock/", include(…))``), served by
waitress, in headless Chromium: Django's login page, staff users read, the permission
``celery_pglock.steer`` acts. No worker is needed: the pages read the ledger and the app's
beat schedule (``tests.apps.testapp``), and a pause is a row."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from selenium.webdriver.common.by import By

from tests.acceptance.beat_support import prepare_schema
from tests.acceptance.browser import HTTP_TIMEOUT, browser, click_through, free_port, screenshot
from tests.acceptance.controls_lab import DEADLINE, ROOT, Lab
from tests.apps.harness import app_env
from tests.fixtures.pg import drop_schema
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance

USER_PASSWORD = "dj4ngo-pw"  # noqa: S105 - the test users' password
__all__ = ["browser"]  # the module's browser (tests/acceptance/browser.py)


@dataclass
class Site:
    lab: Lab
    url: str

    def answers(self) -> bool:
        try:
            urllib.request.urlopen(self.url + "/admin/login/", timeout=HTTP_TIMEOUT)  # noqa: S310 - loopback
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def site(pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    schema = f"t_djdash_{uuid.uuid4().hex[:8]}"
    prepare_schema(pg_dsn, schema)
    env = app_env(pg_dsn=pg_dsn, schema=schema, broker_url=redis_url, TEST_BEAT_EVERY="60")
    env["DJANGO_SETTINGS_MODULE"] = "tests.apps.django_dash.settings"
    log_dir = tmp_path_factory.mktemp("django-dashboard")
    procs = Procs(log_dir, cwd=ROOT)
    try:
        with (log_dir / "setup.log").open("wb") as log:
            subprocess.run(
                [sys.executable, "-m", "tests.apps.django_dash.setup_db", USER_PASSWORD],
                env={**procs_env(), **env},
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                check=True,
                timeout=120,
            )
        port = free_port()
        procs.start(
            [
                sys.executable,
                "-m",
                "waitress",
                f"--listen=127.0.0.1:{port}",
                "tests.apps.django_dash.wsgi:application",
            ],
            env=env,
            name="django-waitress",
        )
        found = Site(Lab(env, pg_dsn, schema), f"http://127.0.0.1:{port}")
        wait_until(found.answers, timeout=DEADLINE, message="the Django site to answer")
        yield found
    finally:
        procs.stop_all()
        drop_schema(pg_dsn, schema)


def procs_env() -> dict[str, str]:
    import os  # noqa: PLC0415

    return {**os.environ, "PYTHONPATH": str(ROOT)}


def log_in(driver: Any, site: Site, user: str, then: str) -> None:
    driver.delete_all_cookies()
    driver.get(f"{site.url}/admin/login/?next={then}")
    driver.find_element(By.ID, "id_username").send_keys(user)
    driver.find_element(By.ID, "id_password").send_keys(USER_PASSWORD)
    click_through(driver, driver.find_element(By.CSS_SELECTOR, "input[type=submit]"))


def test_a_staff_user_logs_in_and_sees_the_overview(
    site: Site, browser: Any, tmp_path: Path
) -> None:
    browser.delete_all_cookies()
    browser.get(site.url + "/pglock/")
    assert "/admin/login/" in browser.current_url  # nobody logged in: Django's login

    log_in(browser, site, "sam", "/pglock/")

    assert browser.current_url.endswith("/pglock/")
    assert browser.find_element(By.CSS_SELECTOR, 'tr[data-entry="tick"]')
    assert "read-only" in browser.find_element(By.TAG_NAME, "nav").text
    link = browser.find_element(By.LINK_TEXT, "tick").get_attribute("href")
    assert link.endswith("/pglock/entry/tick")
    screenshot(browser, "django", tmp_path)


def test_a_user_without_the_permission_cannot_act_and_one_with_it_can(
    site: Site, browser: Any
) -> None:
    log_in(browser, site, "sam", "/pglock/entry/tick")
    browser.find_element(By.ID, "pause-reason").send_keys("not mine to pause")
    click_through(browser, browser.find_element(By.ID, "pause"))
    assert "sam may not act here." == browser.find_element(By.ID, "error").text
    assert [] == site.lab.rows("SELECT * FROM {}", "pglock_pauses")

    log_in(browser, site, "olga", "/pglock/entry/tick")
    browser.find_element(By.ID, "pause-reason").send_keys("release day")
    click_through(browser, browser.find_element(By.ID, "pause"))
    click_through(browser, browser.find_element(By.ID, "confirm"))
    notice = browser.find_element(By.ID, "done").text
    assert notice.startswith("pause: done at "), notice
    assert "paused by web:olga: release day" in notice
    assert f"{site.url}/pglock/entry/tick?" in browser.current_url  # redirected there
    [row] = site.lab.rows("SELECT * FROM {}", "pglock_pauses")
    assert ("web:olga", "release day") == (row["paused_by"], row["reason"])


def test_a_user_who_is_not_staff_cannot_read(site: Site, browser: Any) -> None:
    log_in(browser, site, "nina", "/pglock/")  # the admin's login takes staff only
    browser.get(site.url + "/pglock/")
    assert "/admin/login/" in browser.current_url
    assert [] == browser.find_elements(By.CSS_SELECTOR, "tr[data-entry]")
