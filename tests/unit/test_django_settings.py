"""Every Django setting the docs name under Celery's ``CELERY_`` namespace is one Celery
passes on as a known ``pglock_*`` setting: ``config_from_object(…, namespace="CELERY")``
reads ``CELERY_PGLOCK_X`` as ``pglock_x``, and an unknown ``pglock_`` setting stops every
worker at start-up. The dashboard's own Django setting stays outside that namespace."""

from __future__ import annotations

import re
from pathlib import Path

from celery_pglock._config import APP_DEFAULTS
from celery_pglock.contrib.django import DASHBOARD_APP_SETTING as SETTING

ROOT = Path(__file__).resolve().parents[2]
DJANGO_SETTING = re.compile(r"\bCELERY_(PGLOCK_[A-Z0-9_]+)\b")


def documented() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for name in DJANGO_SETTING.findall(page.read_text()):
            found.setdefault(name.lower(), set()).add(page.name)
    return found


def test_every_documented_celery_pglock_django_setting_is_known() -> None:
    unknown = {name: pages for name, pages in documented().items() if name not in APP_DEFAULTS}
    assert {} == unknown
    assert documented()  # the docs do name some


def test_the_dashboards_django_setting_is_outside_celerys_namespace() -> None:
    assert "PGLOCK_DASHBOARD_APP" == SETTING
    assert not SETTING.startswith("CELERY_")
