"""Headless Chromium for the dashboard's tests, driven by Selenium (Debian's ``chromium`` and
``chromium-driver``: Selenium is told where both are and downloads nothing). Import the
``browser`` fixture into a test module: one browser per module."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.wait import WebDriverWait

from tests.fixtures.services import browser_program

HTTP_TIMEOUT = 10.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def browser(chromium: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    binary, driver_path = chromium, browser_program("chromedriver", "chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,860"):
        options.add_argument(argument)
    profile = tmp_path_factory.mktemp("chromium-profile")
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(HTTP_TIMEOUT * 3)
    try:
        yield driver
    finally:
        driver.quit()


def acting_as(driver: Any, authorization: str | None) -> None:
    """Every request of the browser from now on carries this Authorization header."""
    driver.execute_cdp_cmd("Network.enable", {})
    headers = {"Authorization": authorization} if authorization else {}
    driver.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": headers})


def click_through(driver: Any, element: Any) -> None:
    """Click ``element`` (a link or a form's button) and wait until the next page has
    replaced this one: a look right after a click may otherwise still see the old page."""
    page = driver.find_element(By.TAG_NAME, "html")
    element.click()
    WebDriverWait(driver, HTTP_TIMEOUT).until(lambda _: replaced(page))


def replaced(page: Any) -> bool:
    """Whether ``page`` (an element of the old page) is gone from the browser's document.

    Selenium's ``staleness_of`` knows one answer for it, a stale element; chromedriver
    156, asked in the middle of the navigation, answers an "unknown error": the node
    "does not belong to the document" (it failed a dashboard test once). Both say gone.
    """
    try:
        page.is_enabled()
    except StaleElementReferenceException:
        return True
    except WebDriverException as exc:
        if "does not belong to the document" in str(exc):
            return True
        raise
    return False


def screenshot(driver: Any, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("PGLOCK_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(folder / f"dashboard-{name}.png"))


__all__ = ["acting_as", "browser", "click_through", "free_port", "screenshot"]
