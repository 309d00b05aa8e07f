"""`MeteredBroker`: a `Broker` that reports bytes, waits and dead letters to a recorder.

Wrapping the handle a role opens (`Backends.open_broker`) measures every role alike without a
line in their code: bytes of each publish and delivery, the time spent blocked in `get` (the
busy fraction is the rest), and each dead letter by its reason code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from broker.transport import Broker, Delivery, Headers, QueueSpec
from services.metrics.recorder import Metrics, reason_code

# A delivery rejected without a reason goes to the dead-letter queue by the queue's own routing.
NACK_REASON = "nack"


class MeteredBroker:
    def __init__(self, inner: Broker, metrics: Metrics) -> None:
        self._inner = inner
        self._metrics = metrics

    @property
    def inner(self) -> Broker:
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
        self._metrics.bytes_out(len(body))

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        self._inner.subscribe(queue, prefetch=prefetch)

    def unsubscribe(self, queue: str) -> None:
        self._inner.unsubscribe(queue)

    def get(self, timeout: float) -> Delivery | None:
        started = time.perf_counter()
        delivery = self._inner.get(timeout)
        self._metrics.waited(time.perf_counter() - started)
        if delivery is not None:
            self._metrics.bytes_in(len(delivery.body))
        return delivery

    def ack(self, delivery: Delivery) -> None:
        self._inner.ack(delivery)

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        self._inner.nack(delivery, requeue=requeue)
        if not requeue:
            self._metrics.dead_lettered(NACK_REASON)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._inner.dead_letter(delivery, reason)
        self._metrics.dead_lettered(reason_code(reason))

    def queue_depth(self, queue: str) -> int:
        return self._inner.queue_depth(queue)

    def delete_queue(self, queue: str) -> None:
        self._inner.delete_queue(queue)

    def close(self) -> None:
        self._inner.close()


def _check(broker: MeteredBroker) -> Broker:
    return broker  # mypy: MeteredBroker satisfies the protocol
