"""Ledger retention: delete old runs, skips, beat send claims and holder rows, in batches.

The ledger is what makes a late duplicate a skip ("this slot already succeeded"), so a
deleted row is a slot that could run again. Retention is therefore a promise about how
late duplicates may arrive: rows are deleted only when untouched for longer than it,
never a ``running`` row (or holder row) whose holder still holds the lock, and never faster than
``MIN_RETENTION`` (brokers redeliver within their visibility timeout, one hour by default
on Redis; beat only ever claims slots younger than its grace period, seconds).

Deletes run in batches of ``BATCH`` rows, each its own short transaction, and skip rows
another transaction has locked (``FOR UPDATE SKIP LOCKED``): a claim in progress is never
waited for, and never waits long behind the pruner.

``pglock_ledger_retention`` makes the beat leader prune automatically (``AutoPrune``), at
most once per ``AUTO_PRUNE_EVERY``, a bounded number of batches per tick.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from celery_pglock._config import Settings, setting
from celery_pglock.errors import ConfigurationError, PgLockError
from celery_pglock.store.statements import Statements, opened

logger = logging.getLogger("celery_pglock")

BATCH = 1000
MIN_RETENTION = timedelta(hours=1)
AUTO_PRUNE_EVERY = 3600.0  # seconds between two automatic passes
AUTO_PRUNE_CONTINUE = 1.0  # seconds before the next slice of an unfinished pass
AUTO_PRUNE_RETRY = 300.0  # seconds before retrying a pass that failed
AUTO_PRUNE_BATCHES = 20  # batches per table per tick: bounds the time taken from beat

#: What prune deletes from, in order (the skip log first: it only feeds counts).
PRUNED_TABLES = ("skips", "runs", "beat_sends", "holders", "row_locks")

_LIKE_SPECIAL = re.compile(r"([\\%_])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$", re.IGNORECASE)


def parse_duration(value: object, name: str = "duration") -> timedelta:
    """``7d``, ``12h``, ``90m``, ``30s``, ``2w``, a number of seconds, or a ``timedelta``."""
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = float(match.group(1)) * _UNITS[(match.group(2) or "s").lower()]
    else:
        raise ConfigurationError(
            f"{name} must be a duration such as '7d', '12h', '90m', '30s' or a number of "
            f"seconds, got {value!r}"
        )
    if seconds <= 0:
        raise ConfigurationError(f"{name} must be positive, got {value!r}")
    return timedelta(seconds=seconds)


def parse_since(value: str, now: datetime | None = None) -> datetime:
    """A duration back from ``now`` (``2h``, ``7d``), or an ISO-8601 time (UTC if naive)."""
    now = now or datetime.now(timezone.utc)
    try:
        return now - parse_duration(value, "since")
    except ConfigurationError:
        pass
    try:
        moment = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ConfigurationError(
            f"--since takes a duration back from now ('2h', '7d') or an ISO-8601 time "
            f"('2026-11-29T03:00:00Z'), got {value!r}"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def check_retention(retention: timedelta) -> timedelta:
    """Refuse a retention so short that a redelivered duplicate could run twice."""
    if retention < MIN_RETENTION:
        raise ConfigurationError(
            f"a ledger retention of {retention.total_seconds():.0f} s is shorter than the "
            f"minimum {MIN_RETENTION.total_seconds():.0f} s: a broker redelivery or a late "
            "duplicate arriving after the prune would run its slot again"
        )
    return retention


def retention_setting(conf: Mapping[str, Any]) -> timedelta | None:
    """``pglock_ledger_retention`` as a checked ``timedelta``, or None when unset."""
    value = setting(conf, "pglock_ledger_retention")
    if value is None or value is False:
        return None
    return check_retention(parse_duration(value, "pglock_ledger_retention"))


@dataclass
class PruneResult:
    """Rows deleted per table; ``complete`` is False when ``max_batches`` stopped early."""

    older_than: timedelta
    deleted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PRUNED_TABLES, 0))
    complete: bool = True

    @property
    def total(self) -> int:
        return sum(self.deleted.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "older_than_seconds": self.older_than.total_seconds(),
            "deleted": dict(self.deleted),
            "complete": self.complete,
        }


def prune(
    statements: Statements,
    older_than: timedelta,
    *,
    batch: int = BATCH,
    max_batches: int | None = None,
    namespace: str | None = None,
) -> PruneResult:
    """Delete rows untouched for longer than ``older_than`` (see the module docstring).

    ``namespace``: only rows of lock names ``"<namespace>:…"`` and beat claims of that
    namespace, so an app never prunes another's rows in shared tables; None: every row.
    """
    check_retention(older_than)
    result = PruneResult(older_than)
    params = {
        "seconds": older_than.total_seconds(),
        "batch": batch,
        "namespace": namespace,
        "prefix": None if namespace is None else _LIKE_SPECIAL.sub(r"\\\1", namespace) + ":%",
    }
    for table in PRUNED_TABLES:
        deleted, done = _prune_table(statements, f"prune_{table}", params, max_batches)
        result.deleted[table] = deleted
        result.complete = result.complete and done
    return result


def _prune_table(
    statements: Statements, name: str, params: dict[str, Any], max_batches: int | None
) -> tuple[int, bool]:
    """Run one table's batch delete until a batch comes back short; (deleted, finished)."""
    deleted = batches = 0
    while max_batches is None or batches < max_batches:
        with statements.transaction():
            count = statements.run(name, params)
        deleted += count
        batches += 1
        if count < params["batch"]:
            return deleted, True
    return deleted, False


class AutoPrune:
    """Applies ``pglock_ledger_retention`` from a long-running process (the beat leader).

    ``maybe_run()`` is cheap when nothing is due (one clock read); a due pass deletes at
    most ``AUTO_PRUNE_BATCHES`` batches per table and continues on the next call, so a
    large backlog never stalls the caller for long. Failures are logged once per streak.
    """

    def __init__(
        self,
        settings: Settings,
        retention: timedelta | None,
        *,
        every: float = AUTO_PRUNE_EVERY,
        clock: Callable[[], float] = time.monotonic,
        namespace: str | None = None,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.retention = retention
        self.every = every
        self.clock = clock
        self.next_at = clock()
        self._failing = False

    @classmethod
    def from_conf(
        cls, conf: Mapping[str, Any], settings: Settings, namespace: str | None = None
    ) -> AutoPrune:
        return cls(settings, retention_setting(conf), namespace=namespace)

    def maybe_run(self) -> PruneResult | None:
        """Prune if a pass is due; the result of this slice, or None if nothing ran."""
        if self.retention is None or self.clock() < self.next_at:
            return None
        try:
            with opened(self.settings) as statements:
                result = prune(
                    statements,
                    self.retention,
                    max_batches=AUTO_PRUNE_BATCHES,
                    namespace=self.namespace,
                )
        except PgLockError as exc:
            self._failed(exc)
            return None
        self._succeeded(result)
        return result

    def _succeeded(self, result: PruneResult) -> None:
        self._failing = False
        self.next_at = self.clock() + (self.every if result.complete else AUTO_PRUNE_CONTINUE)
        if result.total:
            logger.info(
                "pruned %d ledger rows older than %s (%s)",
                result.total,
                self.retention,
                ", ".join(f"{table}: {n}" for table, n in result.deleted.items()),
                extra={"action": "pglock_ledger_pruned", "deleted": result.deleted},
            )

    def _failed(self, exc: BaseException) -> None:
        self.next_at = self.clock() + AUTO_PRUNE_RETRY
        if not self._failing:
            self._failing = True
            logger.warning(
                "ledger pruning failed, retrying in %.0f s: %s",
                AUTO_PRUNE_RETRY,
                exc,
                extra={"action": "pglock_ledger_prune_failed"},
            )
