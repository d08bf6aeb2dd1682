"""Beat's producer: a queue declared on this connection is not bound again per message.

kombu's ``maybe_declare`` binds a copy of the queue to the channel before it looks in the
connection's cache of declared entities, on every publish: a tick that sent 10,000
messages took 3.1 s with that copy and 2.5 s without (docs/benchmarks.md §15). The same
cache is looked at first here, without the copy; anything not found in it (first use,
after a reconnect, an entity kombu does not cache) goes through kombu's own declare.
"""

from __future__ import annotations

from typing import Any


def declaring_once(producer_class: type[Any]) -> type[Any]:
    """``producer_class`` (the app's ``amqp.Producer``) with the cheap cache look first."""
    if issubclass(producer_class, _CachedDeclares):
        return producer_class
    return type(producer_class.__name__, (_CachedDeclares, producer_class), {})


class _CachedDeclares:
    channel: Any

    def maybe_declare(self, entity: Any, retry: bool = False, **retry_policy: Any) -> Any:
        if entity and _declared(entity, self.channel):
            return False  # what kombu answers for a cached declaration
        return super().maybe_declare(entity, retry, **retry_policy)  # type: ignore[misc]


def _declared(entity: Any, channel: Any) -> bool:
    connection = getattr(channel, "connection", None)
    if not connection or not entity.can_cache_declaration:
        return False
    return hash(entity) in connection.client.declared_entities
