"""docker-compose.yml is checked without Docker: services, replicas, commands, healthchecks."""

from __future__ import annotations

import contextlib
import importlib
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
APP_SERVICES = ("beat", "worker", "flower")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


@contextlib.contextmanager
def plain_example() -> Iterator[Any]:
    """``examples/plain``'s ``proj`` package, imported as the containers import it."""
    sys.path.insert(0, str(ROOT / "examples" / "plain"))
    try:
        yield importlib.import_module("proj")
    finally:
        sys.path.remove(str(ROOT / "examples" / "plain"))
        for name in [m for m in sys.modules if m.split(".")[0] == "proj"]:
            del sys.modules[name]


def test_compose_has_the_documented_services(services: dict[str, dict[str, Any]]) -> None:
    """postgres, redis, beat, worker and flower; 2 beat replicas and 3 workers."""
    assert {"postgres", "redis", "beat", "worker", "flower"} == set(services)
    assert 2 == services["beat"]["deploy"]["replicas"]
    assert 3 == services["worker"]["deploy"]["replicas"]


def test_every_service_has_a_healthcheck(services: dict[str, dict[str, Any]]) -> None:
    """Each service says how to tell it is healthy, in a form Docker runs."""
    for name, service in services.items():
        test = service.get("healthcheck", {}).get("test")
        assert test, f"{name} has no healthcheck"
        assert test[0] in ("CMD", "CMD-SHELL"), f"{name}: {test!r}"


def test_app_services_build_the_plain_example(services: dict[str, dict[str, Any]]) -> None:
    """beat, worker and flower build examples/plain/Dockerfile, which ships the proj package."""
    for name in APP_SERVICES:
        build = services[name]["build"]
        dockerfile = ROOT / build["context"] / build["dockerfile"]
        assert dockerfile == ROOT / "examples" / "plain" / "Dockerfile", name
    text = (ROOT / "examples" / "plain" / "Dockerfile").read_text()
    assert "COPY examples/plain/proj ./proj" in text
    assert (ROOT / "examples" / "plain" / "proj" / "celery.py").is_file()


def test_commands_run_the_example_app(services: dict[str, dict[str, Any]]) -> None:
    """Each app service runs `celery -A proj <its role>`; the proj app is the retrofitted one."""
    for name in APP_SERVICES:
        argv = services[name]["command"]
        assert ["celery", "-A", "proj", name] == argv[:4], argv
    with plain_example() as proj:
        conf = proj.app.conf
        assert "celery_pglock.beat:PgLockScheduler" == conf.beat_scheduler
        assert "celery_pglock:PgLockTask" == proj.app.task_cls
    worker_check = shlex.split(services["worker"]["healthcheck"]["test"][1])
    assert ["celery", "-A", "proj", "inspect", "ping"] == worker_check[:5]


def test_app_services_point_at_the_compose_postgres_and_redis(
    services: dict[str, dict[str, Any]],
) -> None:
    """DATABASE_URL names the postgres service and its credentials; the broker is redis."""
    postgres = services["postgres"]["environment"]
    for name in APP_SERVICES:
        env = services[name]["environment"]
        db = urlsplit(env["DATABASE_URL"])
        assert ("postgres", postgres["POSTGRES_USER"], postgres["POSTGRES_PASSWORD"]) == (
            db.hostname,
            db.username,
            db.password,
        )
        assert "/" + postgres["POSTGRES_DB"] == db.path
        assert "redis" == urlsplit(env["CELERY_BROKER_URL"]).hostname
        waits = services[name]["depends_on"]
        assert {"postgres", "redis"} <= set(waits)
        assert {"service_healthy"} == {waits[s]["condition"] for s in ("postgres", "redis")}


def test_published_ports_listen_on_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    """Flower (the only published port) is reachable from this machine only."""
    published = [port for s in services.values() for port in s.get("ports", [])]
    assert published == ["127.0.0.1:5555:5555"]
