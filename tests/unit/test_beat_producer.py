"""Beat's producer looks in kombu's cache of declared queues before binding a copy.

On kombu's in-memory transport (a real transport, in this process): what is declared,
and when, is kombu's answer either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Producer, Queue

from celery_pglock.beat._producer import declaring_once


@pytest.fixture
def connection() -> Iterator[Connection]:
    with Connection("memory://") as conn:
        yield conn


def _publish(producer: Any, queue: Queue, body: str) -> None:
    producer.publish(body, routing_key=queue.name, declare=[queue])


def test_the_producer_class_keeps_its_name_and_is_wrapped_once() -> None:
    wrapped = declaring_once(Producer)
    assert issubclass(wrapped, Producer)
    assert wrapped.__name__ == "Producer"
    assert declaring_once(wrapped) is wrapped


@pytest.fixture
def declared(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the queues declared, in order."""
    names: list[str] = []
    declare = Queue.declare

    def counting(self: Queue, *args: Any, **kwargs: Any) -> Any:
        names.append(self.name or "")
        return declare(self, *args, **kwargs)

    monkeypatch.setattr(Queue, "declare", counting)
    return names


def test_a_queue_is_declared_on_first_use_and_every_message_reaches_it(
    connection: Connection, declared: list[str]
) -> None:
    queue = Queue("beat-first-use")
    producer = declaring_once(Producer)(connection)
    _publish(producer, queue, "one")
    _publish(producer, queue, "two")
    assert declared == ["beat-first-use"]
    bound = queue(connection.default_channel)
    assert [bound.get().payload, bound.get().payload] == ["one", "two"]


def test_a_queue_is_declared_again_once_kombu_forgets_it(
    connection: Connection, declared: list[str]
) -> None:
    queue = Queue("beat-forgotten")
    producer = declaring_once(Producer)(connection)
    _publish(producer, queue, "one")
    connection.declared_entities.clear()  # what kombu does on a reconnect
    _publish(producer, queue, "two")
    assert declared == ["beat-forgotten", "beat-forgotten"]


def test_a_queue_kombu_does_not_cache_is_declared_every_time(
    connection: Connection, declared: list[str]
) -> None:
    queue = Queue("beat-auto-delete", auto_delete=True)
    producer = declaring_once(Producer)(connection)
    _publish(producer, queue, "one")
    _publish(producer, queue, "two")
    assert declared == ["beat-auto-delete", "beat-auto-delete"]
