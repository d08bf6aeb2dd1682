"""What the worker processes of a benchmark report to its harness: fixed-size records
through the FIFO ``BENCH_FIFO`` (read by ``benchmarks.workers.Collector``).

A record is (kind, contender, pid, t0, t1): the monotonic clock at ``task_prerun`` and
``task_postrun``, when a skip was decided, when a body ran. ``CLOCK_MONOTONIC`` is
system-wide, so the harness can compare these times across processes. One ``write`` of a
few bytes costs about a microsecond, the same for every contender.
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Mapping
from typing import Any

from celery import signals

RECORD = struct.Struct("<HHidd")  # kind, contender, pid, t0, t1
PRERUN_POSTRUN, SKIP_DECIDED, BODY_RAN = 1, 2, 3


class _Reporter:
    fd = -1
    started = 0.0


def report(kind: int, t0: float, t1: float, contender: int = 0) -> None:
    """Write one record (nothing outside a benchmark: no ``BENCH_FIFO``)."""
    if _Reporter.fd < 0:
        path = os.environ.get("BENCH_FIFO")
        if not path:
            return
        _Reporter.fd = os.open(path, os.O_WRONLY)
    os.write(_Reporter.fd, RECORD.pack(kind, contender, os.getpid(), t0, t1))


def started() -> float:
    """When the task running in this process passed ``task_prerun``."""
    return _Reporter.started


def time_tasks(codes: Mapping[str, int]) -> None:
    """Report each task named in ``codes``, from ``task_prerun`` to ``task_postrun``."""

    def prerun(**_: Any) -> None:
        _Reporter.started = time.monotonic()

    def postrun(task: Any = None, **_: Any) -> None:
        name = getattr(task, "name", "")
        if name in codes:
            report(PRERUN_POSTRUN, _Reporter.started, time.monotonic(), codes[name])

    signals.task_prerun.connect(prerun, weak=False)
    signals.task_postrun.connect(postrun, weak=False)


@signals.worker_process_init.connect
def _reset_reporter(**_: Any) -> None:
    _Reporter.fd = -1  # inherited across fork: reopen in each child
