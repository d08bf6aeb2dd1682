"""Settings: read once from ``app.conf.pglock_*`` (and task attributes) into frozen dataclasses."""

from __future__ import annotations

import difflib
import inspect
import os
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_pglock import _keys as keys
from celery_pglock import _values as values
from celery_pglock._django_db import django_dsn
from celery_pglock._dsn import check_dsn, redact
from celery_pglock._values import Coalesce, OnDbError, Overlap, Scope
from celery_pglock.errors import ConfigurationError
from celery_pglock.schema import Tables

#: Every ``pglock_*`` name understood as an ``app.conf`` setting, with its default.
APP_DEFAULTS: Mapping[str, Any] = {
    "pglock_dsn": None,
    "pglock_django_database": "default",  # with Django and no DSN: this DATABASES alias
    "pglock_schema": "public",
    "pglock_table_prefix": "pglock_",
    "pglock_auto_migrate": True,
    "pglock_pool_size": None,  # "auto": see celery_pglock.store._database.pool_size
    "pglock_connect_timeout": 5.0,
    # Idle connections of a process are closed after this many seconds (0: kept).
    "pglock_idle_timeout": 30.0,
    # Connection slots of the server a process never takes (left to other clients).
    "pglock_spare_connections": 5,
    # Session-scope locks of a threads/gevent/eventlet worker share one session per process.
    "pglock_shared_sessions": True,
    # How session-scope locks and beat's leadership are held: "advisory" (a session's
    # advisory lock), "rows" (a row with a lease, through any pooler) or "auto" (rows once
    # a transaction pooler is found between us and PostgreSQL, else advisory).
    "pglock_lock_backend": "auto",
    # At start-up, wait for PostgreSQL as Celery waits for its broker (see ``startup``).
    "pglock_connection_retry_on_startup": True,
    "pglock_connection_max_retries": None,  # None (or 0, as in Celery): wait for ever
    "pglock_all_tasks": False,  # lock every task of the app (as each is created)
    "pglock_enabled": True,  # False: the test mode, tasks run unlocked and need no database
    # Task option defaults (each may also be set per task as a task attribute).
    "pglock_key": None,
    "pglock_namespace": None,
    "pglock_scope": "session",
    "pglock_slot": None,
    "pglock_lease": 30.0,
    "pglock_scheduled_only": False,
    "pglock_on_db_error": "retry",
    "pglock_db_max_retries": 10,
    "pglock_coalesce": None,  # None: "latest" for messages beat sent, "all" for the others
    "pglock_max_lateness": None,
    "pglock_check_on_enqueue": False,
    # Unset (None): "skip", except for the app-wide retrofit's own messages (``policy``).
    "pglock_overlap": None,  # "skip", "buffer_one" (one slot waits) or "allow"
    "pglock_concurrency": None,  # runs of one lock name at once (unset: 1)
    # Beat.
    "pglock_beat_leader": True,
    "pglock_beat_lease": 5.0,
    "pglock_beat_align_intervals": True,
    "pglock_beat_resend_after": 30.0,
    "pglock_beat_max_interval": 1.0,
    "pglock_beat_catch_up": "none",
    "pglock_beat_catch_up_limit": 10,
    "pglock_beat_senders": 1,  # processes sharing a large tick's sends (forked by the leader)
    "pglock_overdue_after": None,  # seconds after its due time a slot not succeeded is overdue
    # Operations.
    "pglock_ledger_retention": None,
    "pglock_metrics": False,
    # The web dashboard: who may act (basic auth, or a bearer token); reading needs none.
    "pglock_web_user": None,
    "pglock_web_password": None,
    "pglock_web_token": None,
}

#: Options that ask for overlap protection: declared on a task (or app-wide), they give
#: every message of the task its lock name, whatever locked the task (``policy``).
OVERLAP_OPTIONS = ("pglock_key", "pglock_overlap", "pglock_concurrency")
#: Set on a task class that configuration locked for a whole app (``pglock_all_tasks``).
APP_WIDE_MARK = "_pglock_app_wide"

TASK_OPTIONS = (
    "pglock_key",
    "pglock_namespace",
    "pglock_scope",
    "pglock_slot",
    "pglock_lease",
    "pglock_scheduled_only",
    "pglock_on_db_error",
    "pglock_db_max_retries",
    "pglock_coalesce",
    "pglock_max_lateness",
    "pglock_check_on_enqueue",
    "pglock_overlap",
    "pglock_concurrency",
)


def resolve_dsn(conf: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str:
    """The DSN from ``pglock_dsn``, else ``$PGLOCK_DSN``, else Django's database (in a
    process that configured Django), else ``$DATABASE_URL``."""
    dsn = (
        conf.get("pglock_dsn")
        or environ.get("PGLOCK_DSN")
        or django_dsn(conf.get("pglock_django_database") or "default")
        or environ.get("DATABASE_URL")
    )
    if callable(dsn):
        dsn = dsn()
    if not dsn:
        raise ConfigurationError(
            "celery-pglock has no PostgreSQL to talk to: set app.conf.pglock_dsn = "
            "'postgresql://user@host/dbname', or the environment variable PGLOCK_DSN (a test "
            "suite that should run without PostgreSQL: app.conf.pglock_enabled = False)"
        )
    if not isinstance(dsn, str):
        raise ConfigurationError(f"pglock_dsn must be a str, got {type(dsn).__name__}")
    return check_dsn(dsn)


def check_unknown_settings(names: Any, known: Any = APP_DEFAULTS) -> None:
    """Raise on a ``pglock_*`` name that is not a setting, suggesting the closest one."""
    for name in names:
        if not isinstance(name, str) or not name.lower().startswith("pglock_"):
            continue
        if name.lower() in known:
            continue
        close = difflib.get_close_matches(name.lower(), list(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigurationError(f"unknown celery-pglock setting {name!r}{hint}")


@dataclass(frozen=True)
class Settings:
    """App-wide settings: where the tables live and how to connect."""

    dsn: str
    schema: str = "public"
    table_prefix: str = "pglock_"
    auto_migrate: bool = True
    pool_size: int | None = (
        None  # None: "auto", resolved per process by celery_pglock.store._database
    )
    connect_timeout: float = 5.0
    idle_timeout: float | None = 30.0  # None (pglock_idle_timeout = 0): idle ones are kept
    spare_connections: int = 5  # server slots a process's lock connections never take
    shared_sessions: bool = True  # see celery_pglock._shared
    retry_on_startup: bool = True  # wait for PostgreSQL at start-up (``startup``)
    max_retries: int | None = None  # failed attempts before giving up; None: never
    lock_backend: values.LockBackend = "auto"  # see celery_pglock.store._database.Database

    def __repr__(self) -> str:
        return (
            f"Settings(dsn={redact(self.dsn)!r}, schema={self.schema!r}, "
            f"table_prefix={self.table_prefix!r}, auto_migrate={self.auto_migrate})"
        )

    @property
    def tables(self) -> Tables:
        """Where the tables of these settings live."""
        return Tables(self.schema, self.table_prefix)

    @classmethod
    def from_conf(cls, conf: Mapping[str, Any]) -> Settings:
        check_unknown_settings(conf.keys())
        tables = tables_of(conf)
        return cls(
            dsn=resolve_dsn(conf),
            schema=tables.schema,
            table_prefix=tables.prefix,
            auto_migrate=bool(setting(conf, "pglock_auto_migrate")),
            pool_size=values.pool_size(setting(conf, "pglock_pool_size")),
            connect_timeout=values.positive(
                setting(conf, "pglock_connect_timeout"), "pglock_connect_timeout"
            ),
            idle_timeout=values.idle_timeout(setting(conf, "pglock_idle_timeout")),
            spare_connections=values.spare_connections(setting(conf, "pglock_spare_connections")),
            shared_sessions=enabled_setting(conf, "pglock_shared_sessions"),
            retry_on_startup=enabled_setting(conf, "pglock_connection_retry_on_startup"),
            max_retries=values.max_retries(setting(conf, "pglock_connection_max_retries")),
            lock_backend=values.lock_backend(setting(conf, "pglock_lock_backend")),
        )


@dataclass(frozen=True)
class TaskOptions:
    """How one task is locked, resolved from task attributes over app-wide defaults."""

    key: str | Callable[..., str] | None
    namespace: str
    scope: Scope
    slot: str | Callable[..., Any] | None
    lease: float | None
    scheduled_only: bool
    on_db_error: OnDbError
    db_max_retries: int
    coalesce: Coalesce | None = None  # None: "latest" for beat-sent messages, else "all"
    max_lateness: float | None = None
    check_on_enqueue: bool = False
    overlap: Overlap | None = None  # None: not asked for (``policy.overlap`` decides)
    concurrency: int = 1
    # Locked by the app-wide retrofit (pglock_all_tasks, task_cls), asking nothing of
    # overlap: only duplicates are skipped, and beat's slots are guarded per entry.
    retrofit: bool = False

    @classmethod
    def resolve(
        cls, task: Any, conf: Mapping[str, Any], app_name: str | None, *, app_wide: bool = False
    ) -> TaskOptions:
        """``task``'s options; ``app_wide``: the app's configuration locked it (not a
        ``base=`` of its own), as ``locked_app_wide`` tells for a registered task."""
        value = _task_getter(task, conf)
        scope = value("pglock_scope")
        if scope not in values.SCOPES:
            raise ConfigurationError(
                f"{task.name}: pglock_scope must be 'session' or 'transaction', got {scope!r}"
            )
        on_db_error = value("pglock_on_db_error")
        if on_db_error not in values.ON_DB_ERROR:
            raise ConfigurationError(
                f"{task.name}: pglock_on_db_error must be one of {values.ON_DB_ERROR}, "
                f"got {on_db_error!r}"
            )
        return cls(
            key=values.key_option(value("pglock_key"), task.name),
            namespace=keys.namespace(value("pglock_namespace"), app_name),
            scope=scope,
            slot=values.slot_option(value("pglock_slot"), task.name),
            lease=values.lease(value("pglock_lease"), task.name),
            scheduled_only=bool(value("pglock_scheduled_only")),
            on_db_error=on_db_error,
            db_max_retries=values.positive(
                value("pglock_db_max_retries"), "pglock_db_max_retries", int
            ),
            coalesce=values.coalesce(value("pglock_coalesce"), task.name),
            max_lateness=values.max_lateness(value("pglock_max_lateness"), task.name),
            check_on_enqueue=bool(value("pglock_check_on_enqueue")),
            overlap=values.overlap(value("pglock_overlap"), value("pglock_concurrency"), task.name),
            concurrency=values.concurrency(value("pglock_concurrency"), task.name),
            retrofit=app_wide and all(value(name) is None for name in OVERLAP_OPTIONS),
        )


def locked_app_wide(task: Any) -> bool:
    """Whether configuration locked ``task`` for its whole app: ``pglock_all_tasks``, or
    ``Celery(task_cls=...)`` (the task's class derives from the app's ``Task``), rather
    than a ``base=`` of its own."""
    klass = type(task)
    if getattr(klass, APP_WIDE_MARK, False):
        return True
    app = vars(klass).get("app") or vars(klass).get("_app")
    app_task = getattr(app, "Task", None) if app is not None else None
    return app_task is not None and app_task in klass.__bases__


def setting(conf: Mapping[str, Any], name: str) -> Any:
    """One ``pglock_*`` app setting from ``conf``: its value, or its default when unset.
    Every reader of the settings goes through here (and the functions below)."""
    found = conf.get(name)
    return APP_DEFAULTS[name] if found is None else found


def tables_of(conf: Mapping[str, Any]) -> Tables:
    """Where the tables of ``conf`` live (``pglock_schema``, ``pglock_table_prefix``; an
    empty prefix is a prefix): known without a DSN (``fence()``, the CLI, Django's admin)."""
    schema = values.text(setting(conf, "pglock_schema"), "pglock_schema")
    prefix = values.text(setting(conf, "pglock_table_prefix"), "pglock_table_prefix", empty=True)
    return Tables(schema, prefix)


def namespace_of(conf: Mapping[str, Any], app_name: str | None) -> str:
    """The app-wide namespace of lock names: ``pglock_namespace``, else the app's name."""
    return keys.namespace(setting(conf, "pglock_namespace"), app_name)


def _task_getter(task: Any, conf: Mapping[str, Any]) -> Callable[[str], Any]:
    def app_value(name: str) -> Any:
        return setting(conf, name)

    def value(name: str) -> Any:
        found = getattr(task, name, None)
        if inspect.ismethod(found) and found.__self__ is task:
            # @app.task(pglock_key=f) stores f on the task class, where it becomes a
            # method: call it with the task's arguments only, as documented.
            found = found.__func__
        return app_value(name) if found is None else found

    return value


def enabled_setting(conf: Mapping[str, Any], name: str) -> bool:
    """A boolean app setting; anything but a bool (or None: the default) is refused."""
    value = conf.get(name)
    if value is None:
        return bool(APP_DEFAULTS[name])
    if not isinstance(value, bool):
        raise ConfigurationError(f"{name} must be True or False, got {value!r}")
    return value


_app_settings: weakref.WeakKeyDictionary[Any, Settings] = weakref.WeakKeyDictionary()


def app_settings(app: Any) -> Settings:
    """A Celery app's settings, read once from its ``app.conf``."""
    found = _app_settings.get(app)
    if found is None:
        found = _app_settings[app] = Settings.from_conf(app.conf)
    return found


def web_credentials(
    conf: Mapping[str, Any], environ: Mapping[str, str] = os.environ
) -> dict[str, str]:
    """Who may act on the web dashboard: ``user`` with ``password`` (basic auth) and/or a
    bearer ``token``, from the app's settings, else ``PGLOCK_WEB_USER``,
    ``PGLOCK_WEB_PASSWORD`` and ``PGLOCK_WEB_TOKEN``; empty: nobody (read-only)."""
    found = {}
    for name in ("user", "password", "token"):
        value = setting(conf, f"pglock_web_{name}") or environ.get(f"PGLOCK_WEB_{name.upper()}")
        if value:
            found[name] = values.text(value, f"pglock_web_{name}")
    if ("user" in found) != ("password" in found):
        raise ConfigurationError("pglock_web_user and pglock_web_password go together: set both")
    return found
