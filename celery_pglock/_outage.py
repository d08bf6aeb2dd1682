"""One ERROR line per outage, not one per task that noticed it (what an outage is, as
against a misconfiguration, ``celery_pglock.store._failures`` decides).

During an outage every locked task fails its acquire and is retried; logging each at
ERROR buries the one line an operator needs. ``OutageLog`` hands out ERROR for the first
failure, WARNING for the rest, and logs one INFO line when PostgreSQL answers again.
"""

from __future__ import annotations

import logging
import threading


class OutageLog:
    """Per-process outage state; ``succeeded()`` costs one attribute read when all is well."""

    def __init__(self, logger: logging.Logger, action: str) -> None:
        self.logger = logger
        self.action = action
        self.active = False
        self._lock = threading.Lock()

    def failed(self) -> int:
        """The level to log this failure at: ERROR if it starts an outage, else WARNING."""
        with self._lock:
            first, self.active = not self.active, True
        return logging.ERROR if first else logging.WARNING

    def succeeded(self) -> None:
        """PostgreSQL answered: end the outage, saying so once."""
        if not self.active:
            return
        with self._lock:
            if not self.active:
                return
            self.active = False
        self.logger.info("PostgreSQL is reachable again", extra={"action": self.action})
