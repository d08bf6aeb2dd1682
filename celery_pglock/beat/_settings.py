"""Beat's settings, read once when the scheduler starts: ``pglock_beat_*`` and the
per-entry options (``options={"pglock_catch_up": ...}``), all checked up front."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from celery_pglock._config import Settings, app_settings, namespace_of, setting
from celery_pglock._values import CatchUp, catch_up_option, overdue_option, senders_option
from celery_pglock.errors import ConfigurationError
from celery_pglock.store._connections import HOSTNAME

logger = logging.getLogger("celery_pglock.beat")

# Per-entry settings read from an entry's ``options`` (and stripped before sending).
CATCH_UP_OPTION = "pglock_catch_up"
CATCH_UP_LIMIT_OPTION = "pglock_catch_up_limit"
OVERDUE_OPTION = "pglock_overdue_after"
ENTRY_OPTIONS = (CATCH_UP_OPTION, CATCH_UP_LIMIT_OPTION, OVERDUE_OPTION)


@dataclass(frozen=True)
class BeatSettings:
    """How one beat process schedules: frozen, so each tick reads the same values."""

    settings: Settings  # the app's: where the tables are, how to connect
    namespace: str
    leader_mode: bool  # pglock_beat_leader: one replica sends (else every replica does)
    lease: float
    align_intervals: bool
    resend_after: float
    max_interval: float
    catch_up: tuple[CatchUp, int]  # the app's policy and bound
    overdue_after: float | None  # the app's freshness deadline (None: off)
    replica: str  # host:pid, recorded with each claim
    senders: int = 1  # pglock_beat_senders: processes sharing a large tick's sends

    @classmethod
    def from_app(cls, app: Any) -> BeatSettings:
        conf = app.conf
        return cls(
            settings=app_settings(app),
            namespace=namespace_of(conf, app.main),
            leader_mode=bool(setting(conf, "pglock_beat_leader")),
            lease=float(setting(conf, "pglock_beat_lease")),
            align_intervals=bool(setting(conf, "pglock_beat_align_intervals")),
            resend_after=float(setting(conf, "pglock_beat_resend_after")),
            max_interval=float(setting(conf, "pglock_beat_max_interval")),
            catch_up=_catch_up_conf(conf),
            overdue_after=_overdue_conf(conf),
            replica=f"{HOSTNAME}:{os.getpid()}",
            senders=senders_option(setting(conf, "pglock_beat_senders")),
        )

    @property
    def grace(self) -> float:
        """How late a slot may still be sent (older ones were missed while no one led)."""
        return max(10.0, 3 * self.lease)

    def entry_catch_up(self, entry: Any) -> tuple[CatchUp, int]:
        """The entry's catch-up policy and bound: its ``options`` over the app's."""
        policy, limit = self.catch_up
        options = entry.options or {}
        try:
            return catch_up_option(
                options.get(CATCH_UP_OPTION, policy),
                options.get(CATCH_UP_LIMIT_OPTION, limit),
                f"beat entry {entry.name!r}",
            )
        except ConfigurationError as exc:  # an entry edited at run time (django-celery-beat)
            logger.error(
                "%s; using the app's %r", exc, policy, extra={"action": "pglock_beat_bad_option"}
            )
            return policy, limit

    def entry_overdue_after(self, entry: Any) -> float | None:
        """The entry's freshness deadline: its ``options`` over the app's (None: off)."""
        options = entry.options or {}
        where = f"beat entry {entry.name!r}"
        try:
            return overdue_option(options.get(OVERDUE_OPTION, self.overdue_after), where)
        except ConfigurationError as exc:  # an entry edited at run time (django-celery-beat)
            logger.error("%s; using the app's", exc, extra={"action": "pglock_beat_bad_option"})
            return self.overdue_after


def _overdue_conf(conf: Any) -> float | None:
    """The app's freshness deadline, and every ``beat_schedule`` entry's, checked."""
    default = overdue_option(setting(conf, "pglock_overdue_after"), "app.conf")
    for name, spec in (conf.get("beat_schedule") or {}).items():
        options = (spec.get("options") if isinstance(spec, dict) else None) or {}
        if OVERDUE_OPTION in options:
            overdue_option(options[OVERDUE_OPTION], f"beat_schedule[{name!r}].options")
    return default


def _catch_up_conf(conf: Any) -> tuple[CatchUp, int]:
    """The app's catch-up policy, and every ``beat_schedule`` entry's, checked at start-up."""
    policy = setting(conf, "pglock_beat_catch_up")
    limit = setting(conf, "pglock_beat_catch_up_limit")
    default = catch_up_option(policy, limit, "app.conf")
    for name, spec in (conf.get("beat_schedule") or {}).items():
        options = (spec.get("options") if isinstance(spec, dict) else None) or {}
        catch_up_option(
            options.get(CATCH_UP_OPTION, policy),
            options.get(CATCH_UP_LIMIT_OPTION, limit),
            f"beat_schedule[{name!r}].options",
        )
    return default
