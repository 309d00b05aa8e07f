"""`ForwardingBroker`: a `Broker` that hands every call to another one.

The base of broker decorators (metering, user_id stamping, probes): each overrides only the
calls it changes, so a method added to the protocol needs one forwarding line here, not one
in every wrapper.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.errors import BrokerError
from broker.transport import Broker, Delivery, Headers, QueueSpec

__all__ = ["ForwardingBroker"]


class ForwardingBroker:
    def __init__(self, inner: Broker) -> None:
        self._inner = inner

    @property
    def inner(self) -> Broker:
        """The wrapped handle."""
        return self._inner

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        self._inner.declare(queues)

    def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        *,
        headers: Headers | None = None,
        message_id: str | None = None,
        user_id: str | None = None,
        persistent: bool = True,
    ) -> None:
        self._inner.publish(
            exchange,
            routing_key,
            body,
            headers=headers,
            message_id=message_id,
            user_id=user_id,
            persistent=persistent,
        )

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        self._inner.subscribe(queue, prefetch=prefetch)

    def unsubscribe(self, queue: str) -> None:
        self._inner.unsubscribe(queue)

    def get(self, timeout: float) -> Delivery | None:
        return self._inner.get(timeout)

    def ack(self, delivery: Delivery) -> None:
        self._inner.ack(delivery)

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        self._inner.nack(delivery, requeue=requeue)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._inner.dead_letter(delivery, reason)

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        return self._inner.dead_letter_many(letters)

    def queue_depth(self, queue: str) -> int:
        return self._inner.queue_depth(queue)

    def delete_queue(self, queue: str) -> None:
        self._inner.delete_queue(queue)

    def close(self) -> None:
        self._inner.close()


def _check(broker: ForwardingBroker) -> Broker:
    return broker  # mypy: ForwardingBroker satisfies the protocol
