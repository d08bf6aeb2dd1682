"""Settings are read once, validated, and never reveal a password."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from celery import Celery

import celery_pglock
from celery_pglock._config import Settings, TaskOptions, resolve_dsn
from celery_pglock._dsn import redact
from celery_pglock.errors import ConfigurationError


@pytest.fixture(autouse=True)
def _no_django(monkeypatch: pytest.MonkeyPatch) -> None:
    """No Django project here: an earlier test of the session may have configured one,
    whose database the DSN would then fall back to."""
    monkeypatch.setitem(sys.modules, "django.conf", None)


def test_dsn_from_conf_wins_over_environment() -> None:
    """pglock_dsn beats PGLOCK_DSN, which beats DATABASE_URL."""
    env = {"PGLOCK_DSN": "postgresql://env@h/db", "DATABASE_URL": "postgresql://url@h/db"}
    assert "postgresql://conf@h/db" == resolve_dsn({"pglock_dsn": "postgresql://conf@h/db"}, env)
    assert "postgresql://env@h/db" == resolve_dsn({}, env)
    assert "postgresql://url@h/db" == resolve_dsn({}, {"DATABASE_URL": "postgresql://url@h/db"})


def test_missing_dsn_names_the_setting() -> None:
    """With no DSN anywhere, the error says which setting to set."""
    with pytest.raises(ConfigurationError, match="pglock_dsn"):
        resolve_dsn({}, {})


def test_sqlalchemy_style_url_is_accepted() -> None:
    """A postgresql+psycopg:// URL (as SQLAlchemy users have) works as a libpq URL."""
    assert "postgresql://u@h/db" == resolve_dsn({"pglock_dsn": "postgresql+psycopg://u@h/db"}, {})


def test_malformed_dsn_error_hides_password() -> None:
    """A malformed DSN fails with a clear message that never shows the password."""
    with pytest.raises(ConfigurationError) as info:
        resolve_dsn({"pglock_dsn": "postgresql://u:s3cret@h:notaport/db?bogus=1"}, {})
    assert "s3cret" not in str(info.value)
    assert "not a valid PostgreSQL connection string" in str(info.value)


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://user:s3cret@host/db",
        "host=h password=s3cret user=u",
        "host=h password='s3 cret' user=u",
        "PASSWORD = s3cret",
    ],
)
def test_redact_removes_passwords(text: str) -> None:
    """redact() removes the password in URL and key=value forms."""
    assert "s3cret" not in redact(text)
    assert "s3" not in redact(text).replace("***", "")


def test_settings_repr_hides_password() -> None:
    """repr(Settings) shows the DSN without its password."""
    settings = Settings(dsn="postgresql://u:s3cret@h/db")
    assert "s3cret" not in repr(settings)


def test_unknown_setting_suggests_the_right_one() -> None:
    """A typo in a pglock_* setting fails with a suggestion."""
    conf = {"pglock_dsn": "postgresql://u@h/db", "pglock_shcema": "x"}
    with pytest.raises(ConfigurationError, match="did you mean 'pglock_schema'"):
        Settings.from_conf(conf)


def _task(app: Celery, **options: object) -> TaskOptions:
    @app.task(name="t", shared=False, **options)
    def t() -> None:
        """A task."""

    return TaskOptions.resolve(t, app.conf, app.main)


def test_task_options_default_from_app_conf() -> None:
    """Task attributes fall back to app.conf.pglock_* and then to built-in defaults."""
    app = Celery("proj", set_as_current=False)
    app.conf.pglock_scope = "transaction"
    options = _task(app)
    assert ("transaction", "proj", 30.0) == (options.scope, options.namespace, options.lease)


def test_task_attribute_overrides_app_default() -> None:
    """A per-task pglock_scope wins over the app-wide default."""
    app = Celery("proj", set_as_current=False)
    app.conf.pglock_scope = "transaction"
    assert "session" == _task(app, pglock_scope="session").scope


@pytest.mark.parametrize(
    ("option", "value", "match"),
    [
        ("pglock_scope", "global", "pglock_scope"),
        ("pglock_on_db_error", "ignore", "pglock_on_db_error"),
        ("pglock_lease", -1, "pglock_lease"),
        ("pglock_slot", 42, "pglock_slot"),
        ("pglock_key", "", "pglock_key"),
    ],
)
def test_bad_task_options_are_refused(option: str, value: object, match: str) -> None:
    """Invalid per-task options fail with an error naming the option."""
    with pytest.raises(ConfigurationError, match=match):
        _task(Celery("proj", set_as_current=False), **{option: value})


def test_lease_zero_turns_the_lease_off() -> None:
    """pglock_lease = 0 disables the server-enforced lease."""
    assert _task(Celery("proj", set_as_current=False), pglock_lease=0).lease is None


def test_settings_are_read_in_one_place() -> None:
    """Only ``celery_pglock._config`` reads ``pglock_*`` settings from a configuration:
    every other module asks it (``setting``, ``tables_of``, ``namespace_of``, ...), so that
    one setting never means two things (``fence()`` once read ``pglock_table_prefix = ""``
    as ``pglock_``)."""
    package = Path(celery_pglock.__file__).parent
    reading = re.compile(
        r"""(conf|settings)\.get\(\s*["']pglock_|getattr\(settings, ["']CELERY_PGLOCK"""
    )
    found = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "_config.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if reading.search(line)
    ]

    assert [] == found


DSN = "postgresql://app@db/app"


def test_start_up_waits_for_postgresql_for_ever_by_default() -> None:
    """pglock_connection_retry_on_startup is on and pglock_connection_max_retries unset."""
    found = Settings.from_conf({"pglock_dsn": DSN})

    assert (True, None) == (found.retry_on_startup, found.max_retries)


@pytest.mark.parametrize(("given", "expected"), [(None, None), (0, None), (3, 3)])
def test_max_retries_zero_means_for_ever_as_in_celery(given: int | None, expected: int) -> None:
    """None or 0 (Celery's broker_connection_max_retries meaning): no limit; N: N."""
    conf = {"pglock_dsn": DSN, "pglock_connection_max_retries": given}

    assert expected == Settings.from_conf(conf).max_retries


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("pglock_connection_retry_on_startup", "yes"),
        ("pglock_connection_retry_on_startup", 1),
        ("pglock_connection_max_retries", -1),
        ("pglock_connection_max_retries", 2.5),
        ("pglock_connection_max_retries", True),
    ],
)
def test_bad_start_up_retry_settings_are_refused_by_name(name: str, value: object) -> None:
    """A non-bool retry_on_startup or a max_retries that is not an int >= 0 is refused."""
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_conf({"pglock_dsn": DSN, name: value})
