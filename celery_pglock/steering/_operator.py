"""Who steers, and the one way an operator's face opens a connection to PostgreSQL.

The CLI, the dashboard and its background sends each label their connection (what
``pg_stat_activity`` and the server's logs show) and act through the store's named
statements; a long-running command first waits for PostgreSQL, as a worker does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

from celery import Celery

from celery_pglock import _controls as controls
from celery_pglock._config import app_settings
from celery_pglock._startup import wait_for_postgres
from celery_pglock.steering._apps import target
from celery_pglock.store._connections import connect
from celery_pglock.store._driver import Connection
from celery_pglock.store.statements import Statements, adopted

LABEL_BYTES = 63  # PostgreSQL keeps this much of an application_name

logger = logging.getLogger("celery_pglock.steering")


@contextmanager
def connection(
    app: Celery,
    label: str,
    *,
    wait: bool = False,
    who: str = "pglock",
    logger: logging.Logger = logger,
) -> Iterator[Statements]:
    """Statements on a connection of ``app``'s settings, labelled ``label``; ``wait``:
    waiting for PostgreSQL while it is away (``who`` and ``logger`` say so meanwhile)."""
    settings = app_settings(app)
    name = label.encode()[:LABEL_BYTES].decode("utf-8", "ignore")

    def attempt() -> Connection:
        return connect(settings, application_name=name)

    conn = wait_for_postgres(settings, attempt, who=who, logger=logger) if wait else attempt()
    with adopted(conn, settings) as statements:
        yield statements


@dataclass(frozen=True)
class Operator:
    """Who acts on ``app`` (``actor``: the audit's ``user@host``, ``web:<user>``) and how
    their connections are opened (``label``; ``wait``: for PostgreSQL, if away).

    ``opener``, when given, opens the statements instead (a test's in-memory store)."""

    app: Celery
    actor: str
    label: str
    wait: bool = False
    who: str = "pglock"
    logger: logging.Logger = logger
    opener: Callable[[], AbstractContextManager[Statements]] | None = None

    @property
    def target(self) -> controls.Target:
        """Where a control writes, as whom."""
        return target(self.app, self.actor)

    @contextmanager
    def connection(self) -> Iterator[Statements]:
        if self.opener is not None:
            with self.opener() as statements:
                yield statements
            return
        with connection(
            self.app, self.label, wait=self.wait, who=self.who, logger=self.logger
        ) as statements:
            yield statements
