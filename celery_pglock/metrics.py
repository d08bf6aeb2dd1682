"""Optional Prometheus metrics, fed by celery-pglock's signals.

Off unless ``app.conf.pglock_metrics = True`` (needs ``pip install
'celery-pglock[prometheus]'``). Importing this module only connects two start-up hooks
(``worker_init``, ``beat_init``) that read the setting; ``prometheus_client`` is imported
and the signal receivers connected only when it is on, so a disabled app pays nothing
per task.

Metrics (in the default registry unless ``install`` gets another):

- ``pglock_lock_acquisitions_total{task}``: locks granted to a task run;
- ``pglock_task_skips_total{task,reason}``: messages skipped (``locked``, ``done``, …);
- ``pglock_lock_wait_seconds{task}``: from the task starting to the lock being granted
  (pool checkout plus the acquire round trip, two when the first try found the lock
  held; a try-lock never queues);
- ``pglock_lock_hold_seconds{task}``: from the grant to the end of the task;
- ``pglock_lock_losses_total``: locks taken away (lease expired, session terminated);
- ``pglock_beat_leader``: 1 while this beat replica leads, else 0;
- ``pglock_beat_leader_changes_total{change}``: ``elected`` / ``stepped_down``.

Labels are task names, never lock names (a lock per account would explode cardinality).
Under the prefork pool every child counts for itself: expose them with
``prometheus_client``'s multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery import signals as celery_signals

from celery_pglock import signals
from celery_pglock._config import enabled_setting
from celery_pglock.errors import ConfigurationError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

WAIT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
HOLD_BUCKETS = (0.01, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 14400.0)


@dataclass(frozen=True)
class Metrics:
    """The metric objects of one registry."""

    acquisitions: Counter
    skips: Counter
    wait: Histogram
    hold: Histogram
    losses: Counter
    leader: Gauge
    leader_changes: Counter
    last_success: Gauge
    overdue: Gauge
    rogue: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> Metrics:
        try:
            import prometheus_client as prom  # noqa: PLC0415 - optional extra, only when enabled
        except ImportError:
            raise ConfigurationError(
                "pglock_metrics = True needs prometheus-client: "
                "pip install 'celery-pglock[prometheus]'"
            ) from None
        reg = registry if registry is not None else prom.REGISTRY
        return cls(
            acquisitions=prom.Counter(
                "pglock_lock_acquisitions", "Locks granted to a task run.", ["task"], registry=reg
            ),
            skips=prom.Counter(
                "pglock_task_skips",
                "Messages skipped, by reason.",
                ["task", "reason"],
                registry=reg,
            ),
            wait=prom.Histogram(
                "pglock_lock_wait_seconds",
                "Task start to lock granted.",
                ["task"],
                buckets=WAIT_BUCKETS,
                registry=reg,
            ),
            hold=prom.Histogram(
                "pglock_lock_hold_seconds",
                "Lock granted to task end.",
                ["task"],
                buckets=HOLD_BUCKETS,
                registry=reg,
            ),
            losses=prom.Counter(
                "pglock_lock_losses", "Locks taken away from a holder.", registry=reg
            ),
            leader=prom.Gauge(
                "pglock_beat_leader", "1 while this beat replica leads.", registry=reg
            ),
            leader_changes=prom.Counter(
                "pglock_beat_leader_changes", "Beat leadership changes.", ["change"], registry=reg
            ),
            last_success=prom.Gauge(
                "pglock_entry_last_success_timestamp_seconds",
                "When a beat entry's newest succeeded slot finished (pglock_overdue_after set).",
                ["entry"],
                registry=reg,
            ),
            rogue=prom.Counter(
                "pglock_rogue_messages",
                "Messages without a slot of a task a PgLockScheduler sends (a stock beat?).",
                ["task"],
                registry=reg,
            ),
            overdue=prom.Gauge(
                "pglock_entry_overdue",
                "1 while a beat entry has a slot not succeeded past pglock_overdue_after.",
                ["entry"],
                registry=reg,
            ),
        )


class _Recorder:
    """Signal receivers that update one ``Metrics``; timings are per thread (per task)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.local = threading.local()

    def connect(self) -> None:
        celery_signals.task_prerun.connect(self.on_task_prerun, weak=False)
        celery_signals.task_postrun.connect(self.on_task_postrun, weak=False)
        signals.lock_acquired.connect(self.on_lock_acquired, weak=False)
        signals.task_skipped.connect(self.on_task_skipped, weak=False)
        signals.lock_lost.connect(self.on_lock_lost, weak=False)
        signals.beat_leader_changed.connect(self.on_leader_changed, weak=False)
        signals.entry_freshness.connect(self.on_entry_freshness, weak=False)
        signals.rogue_message.connect(self.on_rogue_message, weak=False)

    def on_task_prerun(self, sender: Any = None, **_: Any) -> None:
        self.local.started = time.perf_counter()
        self.local.acquired = None

    def on_lock_acquired(self, sender: Any = None, **_: Any) -> None:
        now = time.perf_counter()
        task = _task_name(sender)
        self.metrics.acquisitions.labels(task=task).inc()
        started = getattr(self.local, "started", None)
        if started is not None:
            self.metrics.wait.labels(task=task).observe(now - started)
        self.local.acquired = now

    def on_task_postrun(self, sender: Any = None, **_: Any) -> None:
        acquired = getattr(self.local, "acquired", None)
        self.local.started = self.local.acquired = None
        if acquired is not None:
            held = time.perf_counter() - acquired
            self.metrics.hold.labels(task=_task_name(sender)).observe(held)

    def on_task_skipped(self, sender: Any = None, reason: str = "", **_: Any) -> None:
        self.metrics.skips.labels(task=_task_name(sender), reason=reason).inc()

    def on_lock_lost(self, sender: Any = None, **_: Any) -> None:
        self.metrics.losses.inc()

    def on_leader_changed(self, sender: Any = None, leader: bool = False, **_: Any) -> None:
        self.metrics.leader.set(1 if leader else 0)
        self.metrics.leader_changes.labels(change="elected" if leader else "stepped_down").inc()

    def on_rogue_message(self, sender: Any = None, **_: Any) -> None:
        self.metrics.rogue.labels(task=_task_name(sender)).inc()

    def on_entry_freshness(
        self, entry: str = "", last_success_at: Any = None, overdue: bool = False, **_: Any
    ) -> None:
        if last_success_at is not None:
            self.metrics.last_success.labels(entry=entry).set(last_success_at.timestamp())
        self.metrics.overdue.labels(entry=entry).set(1 if overdue else 0)


def _task_name(sender: Any) -> str:
    return str(getattr(sender, "name", None) or "")


_installed: Metrics | None = None
_install_lock = threading.Lock()


def install(registry: CollectorRegistry | None = None) -> Metrics:
    """Create the metrics and connect the receivers; once per process (later calls no-op)."""
    global _installed  # noqa: PLW0603 - one set of metrics per process, like the registry
    with _install_lock:
        if _installed is None:
            metrics = Metrics.create(registry)
            _Recorder(metrics).connect()
            _installed = metrics
        return _installed


def enabled(app: Any) -> bool:
    """Whether ``app.conf.pglock_metrics`` asks for metrics."""
    return enabled_setting(app.conf, "pglock_metrics")


@celery_signals.worker_init.connect
def _on_worker_init(sender: Any = None, **_: Any) -> None:
    # Runs in the worker's main process before the pool forks: children inherit receivers.
    app = getattr(sender, "app", None)
    if app is not None and enabled(app):
        install()


@celery_signals.beat_init.connect
def _on_beat_init(sender: Any = None, **_: Any) -> None:
    app = getattr(sender, "app", None)
    if app is not None and enabled(app):
        install()
