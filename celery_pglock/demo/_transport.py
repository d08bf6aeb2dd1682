"""A PostgreSQL-only broker for the demo: kombu's SQLAlchemy transport, polling faster.

Stock ``sqla+postgresql://`` polls every second, and ``polling_interval`` cannot be set
through ``broker_transport_options`` (unknown options go to ``create_engine``, which
rejects them). This subclass polls every 0.1 s and takes the next message with
``FOR UPDATE SKIP LOCKED``, so a worker frozen in the middle of a fetch does not stall the
others. Importing this module registers it as ``pglock-sqla+postgresql+psycopg://…``.
"""

from __future__ import annotations

from json import loads
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES
from kombu.transport import sqlalchemy as kombu_sqla
from kombu.utils.encoding import bytes_to_str
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy.engine import URL

from celery_pglock.demo._schedule import BROKER_ALIAS

ALIAS = BROKER_ALIAS
POLLING_INTERVAL = 0.1


class Channel(kombu_sqla.Channel):
    """The SQLAlchemy channel, fetching with SKIP LOCKED."""

    def _get(self, queue: str, timeout: float | None = None) -> Any:
        channel: Any = self  # kombu's stubs omit the SQLAlchemy channel's helpers
        obj = channel._get_or_create(queue)
        message_cls = channel.message_cls
        session = channel.session
        try:
            msg = (
                session.query(message_cls)
                .with_for_update(skip_locked=True)
                .filter(message_cls.queue_id == obj.id)
                .filter(message_cls.visible.is_(True))
                .order_by(message_cls.sent_at, message_cls.id)
                .limit(1)
                .first()
            )
            if msg is None:
                raise Empty()
            msg.visible = False
            return loads(bytes_to_str(msg.payload))
        finally:
            session.commit()

    def close(self) -> None:
        """Also give the session's connection back (kombu leaves it to the GC)."""
        try:
            super().close()
        finally:
            channel: Any = self
            if channel._session is not None:
                channel._session.close()
                channel._session = None


class Transport(kombu_sqla.Transport):
    """kombu's SQLAlchemy transport with a 0.1 s polling interval."""

    Channel = Channel
    polling_interval = POLLING_INTERVAL


def dispose_engines() -> None:
    """Close this process's broker connections (kombu caches one engine per URL, forever)."""
    engines: dict[str, Any] = kombu_sqla.Channel._engines
    for engine, _ in list(engines.values()):
        engine.dispose()
    engines.clear()


def register() -> None:
    """Make ``pglock-sqla+<sqlalchemy url>`` a broker URL kombu understands. Idempotent."""
    TRANSPORT_ALIASES.setdefault(ALIAS, f"{__name__}:Transport")


def broker_url(dsn: str, schema: str) -> str:
    """The broker URL for a libpq DSN (URL or key=value); its tables go into ``schema``."""
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    port = params.pop("port", None)
    url = URL.create(
        "postgresql+psycopg",
        username=params.pop("user", None),
        password=params.pop("password", None),
        host=params.pop("host", None),
        port=int(port) if port else None,
        database=params.pop("dbname", None),
        query={**params, "options": f"-csearch_path={schema}"},
    )
    return f"{ALIAS}+{url.render_as_string(hide_password=False)}"


register()
