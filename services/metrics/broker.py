"""`MeteredBroker`: a `Broker` that reports bytes, waits and dead letters to a recorder.

Wrapping the handle a role opens (`Backends.open_broker`) measures every role alike without a
line in their code: bytes of each publish and delivery, the time spent blocked in `get` (the
busy fraction is the rest), and each dead letter by its reason code.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from broker.errors import BrokerError
from broker.forwarding import ForwardingBroker
from broker.transport import Broker, Delivery, Headers
from services.metrics.recorder import Metrics, reason_code

# A delivery rejected without a reason goes to the dead-letter queue by the queue's own routing.
NACK_REASON = "nack"


class MeteredBroker(ForwardingBroker):
    def __init__(self, inner: Broker, metrics: Metrics) -> None:
        super().__init__(inner)
        self._metrics = metrics

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
        super().publish(
            exchange,
            routing_key,
            body,
            headers=headers,
            message_id=message_id,
            user_id=user_id,
            persistent=persistent,
        )
        self._metrics.bytes_out(len(body))

    def get(self, timeout: float) -> Delivery | None:
        started = time.perf_counter()
        delivery = self._inner.get(timeout)
        self._metrics.waited(time.perf_counter() - started)
        if delivery is not None:
            self._metrics.bytes_in(len(delivery.body))
        return delivery

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        self._inner.nack(delivery, requeue=requeue)
        if not requeue:
            self._metrics.dead_lettered(NACK_REASON)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._inner.dead_letter(delivery, reason)
        self._metrics.dead_lettered(reason_code(reason))

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        unsettled = self._inner.dead_letter_many(letters)
        left = {id(delivery) for delivery, _ in unsettled}
        for delivery, reason in letters:
            if id(delivery) not in left:
                self._metrics.dead_lettered(reason_code(reason))
        return unsettled
