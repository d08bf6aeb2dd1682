"""Operator controls with django-celery-beat: entries by their periodic tasks' names, and a
pause that is celery-pglock's (the model's ``enabled`` is left as it was)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.acceptance.beat_support import DJANGO_SCHEDULER, migrate_django, prepare_schema
from tests.acceptance.controls_lab import DEADLINE, ROOT, Lab, serving, utcnow
from tests.apps.harness import app_env
from tests.fixtures.procs import Procs, wait_until

pytestmark = pytest.mark.acceptance


@pytest.fixture(scope="module")
def django_lab(
    pg_dsn: str, redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Lab]:
    pytest.importorskip("django_celery_beat", reason="needs django-celery-beat")
    schema = f"t_djcontrols_{uuid.uuid4().hex[:8]}"
    prepare_schema(pg_dsn, schema)
    env = app_env(
        pg_dsn=pg_dsn,
        schema=schema,
        broker_url=redis_url,
        TEST_NAMESPACE=schema,
        TEST_BEAT_SCHEDULER=DJANGO_SCHEDULER,
    )
    log_dir = tmp_path_factory.mktemp("django-controls")
    migrate_django(env, log_dir)
    yield from serving(Lab(env, pg_dsn, schema), Procs(log_dir, cwd=ROOT), ["--pool=solo"], beats=1)


def enabled(lab: Lab) -> bool:
    [row] = lab.rows(
        "SELECT enabled FROM {} WHERE name = 'tick'", "django_celery_beat_periodictask"
    )
    return bool(row["enabled"])


def test_a_django_celery_beat_entry_pauses_by_name_leaving_the_model_enabled(
    django_lab: Lab,
) -> None:
    lab = django_lab
    asked = utcnow()
    code, out = lab.cli("pause", "tick", "--reason", "quiet hours")
    assert 0 == code, out
    assert "unchanged" in out

    held = wait_until(
        lambda: len(lab.runs("paused")) >= 2 and lab.runs("paused"),
        timeout=DEADLINE,
        message="2 slots held back",
    )
    assert enabled(lab)
    assert not {r["slot"] for r in held} & set(lab.executed())
    assert all(r["scheduled_at"] > asked for r in held)

    assert 0 == lab.cli("resume", "tick")[0]
    code, out = lab.cli("schedule", "--entry", "tick", "--next", "2")
    assert 0 == code, out
    assert "tick: testapp.tick" in out
