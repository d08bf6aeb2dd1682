"""Skips explained in Flower: a real ``celery worker -E``, a real Flower, a real browser.

A skipped message's ``task-skipped`` event carries, besides its fields (reason, lock, slot,
holder, token), a one-line ``result``: the one field of those that Flower keeps and shows
(Flower builds tasks from Celery's ``events.state.Task``, which serializes only its own
fields). The tests produce a ``done`` and a ``locked`` skip, read Flower's
``/api/task/info/<id>`` and its task page as headless Chromium renders it (a screenshot is
kept under the test's ``tmp_path``).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from celery_pglock import SKIPPED
from tests.apps import testapp
from tests.apps.harness import (
    DEADLINE,
    WORKER_READY_TIMEOUT,
    Gate,
    configure_client,
    executions_when,
    redis_app_env,
)
from tests.fixtures.procs import Proc, Procs, wait_until

pytestmark = pytest.mark.acceptance

SLOT = "2026-12-01T03:00:00Z"
OTHER_SLOT = "2026-12-02T03:00:00Z"
HTTP_TIMEOUT = 5.0  # seconds, per request to Flower (on loopback)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
HIDDEN = ("script", "style")  # elements whose text a page does not show


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class _Text(HTMLParser):
    """The text of an HTML document, its runs of whitespace collapsed to single spaces."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._hidden: list[str] = []  # the open <script> and <style> elements

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in HIDDEN:
            self._hidden.append(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag in HIDDEN and self._hidden:
            self._hidden.pop()

    def handle_data(self, data: str) -> None:
        if not self._hidden:
            self.parts.append(data)


def page_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    return " ".join(" ".join(parser.parts).split())


@dataclass
class Browser:
    """Headless Chromium, each run a process of the test's (stopped by pid at teardown)."""

    binary: str
    procs: Procs
    tmp_path: Path

    def _run(self, name: str, *args: str, stdout: Path | None = None) -> None:
        argv = [
            self.binary,
            *("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"),
            f"--user-data-dir={self.tmp_path / 'chromium-profile'}",
            *args,
        ]
        if stdout is not None:  # the DOM goes to stdout; Chromium's chatter to the log
            argv = ["sh", "-c", 'out=$1; shift; exec "$@" >"$out"', "sh", str(stdout), *argv]
        proc = self.procs.start(argv, name=name)
        assert 0 == proc.wait(timeout=DEADLINE), f"chromium failed: {proc.log_tail()}"

    def rendered_text(self, url: str) -> str:
        """The page's text once Chromium has loaded and rendered it (``--dump-dom``)."""
        dom = self.tmp_path / f"dom-{uuid.uuid4().hex[:8]}.html"
        self._run("chromium-dom", "--dump-dom", url, stdout=dom)
        return page_text(dom.read_text(encoding="utf-8"))

    def screenshot(self, url: str, name: str) -> Path:
        png = self.tmp_path / f"{name}.png"
        self._run("chromium-shot", f"--screenshot={png}", "--window-size=1280,1600", url)
        return png


@dataclass
class Flower:
    """A real Flower on a loopback port, following the test's worker through its events."""

    url: str
    proc: Proc

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=HTTP_TIMEOUT) as response:  # noqa: S310 - our own loopback URL
            return json.loads(response.read())

    def hears(self, hostname: str) -> bool:
        """Whether Flower has a live worker ``hostname`` in its state (from its events)."""
        try:
            alive: dict[str, bool] = self.get("/api/workers?status=true")
        except urllib.error.HTTPError:
            raise  # Flower answered: not a matter of waiting
        except OSError:  # not listening yet
            return False
        return alive.get(hostname, False)

    def _skipped(self, task_id: str) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = self.get(f"/api/task/info/{task_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:  # Flower has not heard of the task (yet)
                return None
            raise
        return info if info.get("state") == SKIPPED else None

    def skipped_task(self, task_id: str) -> dict[str, Any]:
        """``/api/task/info/<task_id>`` once Flower has the task-skipped event."""
        info: dict[str, Any] = wait_until(
            lambda: self._skipped(task_id),
            timeout=DEADLINE,
            interval=0.2,
            message=f"Flower to show {task_id} as SKIPPED",
        )
        return info


@dataclass
class Monitored:
    schema: str
    dsn: str
    flower: Flower
    browser: Browser

    def lock_name(self, task: str) -> str:
        return f"{self.schema}:{task}"

    def page(self, task_id: str, name: str) -> str:
        """The text of Flower's task page, as Chromium renders it; a screenshot beside it."""
        url = f"{self.flower.url}/task/{task_id}"
        png = self.browser.screenshot(url, name)
        data = png.read_bytes()
        assert data.startswith(PNG_SIGNATURE), f"{png} is not a PNG"
        assert len(data) > 1000, f"{png} is empty ({len(data)} bytes)"
        return self.browser.rendered_text(url)


@pytest.fixture
def monitored(
    *, procs: Procs, chromium: str, pg_dsn: str, pglock_schema: str, redis_url: str, tmp_path: Path
) -> Monitored:
    """A worker with task events (-E) and a Flower that already hears it."""
    env = redis_app_env(pg_dsn=pg_dsn, schema=pglock_schema, redis_url=redis_url)
    configure_client(env)
    hostname = f"fl-{uuid.uuid4().hex[:8]}@{socket.gethostname()}"
    worker = procs.celery(
        "tests.apps.testapp",
        "worker",
        *("-E", "-l", "info", "-P", "prefork", "-c", "2", "-n", hostname),
        *("--without-gossip", "--without-mingle", "-Q", env["TEST_QUEUE"]),
        env=env,
        name="worker",
    )
    port = free_port()
    proc = procs.celery(
        "tests.apps.testapp",
        "flower",
        "--address=127.0.0.1",
        f"--port={port}",
        # Flower's API answers only with authentication or this; loopback only.
        env={**env, "FLOWER_UNAUTHENTICATED_API": "true"},
        name="flower",
    )
    flower = Flower(f"http://127.0.0.1:{port}", proc)
    worker.wait_for_log(f"{hostname} ready.", timeout=WORKER_READY_TIMEOUT)
    # Redis events are pub/sub: Flower hears only what is sent once it listens. The worker
    # alive in Flower's own state (from its heartbeat events) proves it does.
    wait_until(
        lambda: flower.hears(hostname),
        timeout=DEADLINE,
        interval=0.2,
        message=f"Flower to hear {hostname}'s events",
    )
    return Monitored(pglock_schema, pg_dsn, flower, Browser(chromium, procs, tmp_path))


def test_done_skip_is_explained_on_flowers_task_page_and_api(monitored: Monitored) -> None:
    """A duplicate of a done slot: Flower's Result says done, with lock, slot and who ran it."""
    first = testapp.echo.apply_async(("first",), headers={"pglock_slot": SLOT})
    assert "first" == first.get(timeout=DEADLINE)
    duplicate = testapp.echo.apply_async(("second",), headers={"pglock_slot": SLOT})
    meta = duplicate.get(timeout=DEADLINE)
    assert "done" == meta["reason"]

    info = monitored.flower.skipped_task(duplicate.id)

    holder = meta["holder"]
    lock = monitored.lock_name("testapp.echo")
    expected = (
        f"SKIPPED: done (lock '{lock}', slot '{SLOT}', "
        f"holder task {first.id} pid {holder['pid']} on {holder['host']})"
    )
    assert expected == info["result"]
    assert ("testapp.echo", SKIPPED) == (info["name"], info["state"])
    assert f"Result {expected}" in monitored.page(duplicate.id, "done")  # its row


def test_locked_skip_names_the_holder_on_flowers_task_page_and_api(monitored: Monitored) -> None:
    """Another slot while a run holds the lock: Flower's Result says locked, naming the run."""
    with Gate(monitored.dsn) as gate:
        running = testapp.gated.apply_async((gate.id,), headers={"pglock_slot": SLOT})
        [run] = wait_until(
            lambda: executions_when(monitored.dsn, monitored.schema, 1),
            timeout=DEADLINE,
            message="the run holding the lock",
        )
        skipped = testapp.gated.apply_async((gate.id,), headers={"pglock_slot": OTHER_SLOT})
        meta = skipped.get(timeout=DEADLINE)
        assert "locked" == meta["reason"]

        info = monitored.flower.skipped_task(skipped.id)
        text = monitored.page(skipped.id, "locked")
    assert run["token"] == running.get(timeout=DEADLINE)

    lock = monitored.lock_name("testapp.gated")
    expected = (
        f"SKIPPED: locked (lock '{lock}', slot '{OTHER_SLOT}', "
        f"holder task {running.id} of slot '{SLOT}' pid {run['pid']} on {socket.gethostname()})"
    )
    assert expected == info["result"]
    assert f"Result {expected}" in text  # its row on the page
