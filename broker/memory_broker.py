"""The embedded `Broker`: RabbitMQ's semantics inside one process, no server needed.

Each thread opens its own `InMemoryBroker` handle over one shared `InMemoryHub`, as it would open
its own RabbitMQ connection; the hub holds the queues. Everything the contract suite checks on
RabbitMQ holds here too (confirms are implicit: `publish` returns once the message is enqueued).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker.errors import BackPressureError, BrokerError, UnroutableError
from broker.memory_hub import InMemoryHub
from broker.transport import (
    DEFAULT_MAX_MESSAGE_BYTES,
    PLAIN,
    Broker,
    Delivery,
    Meter,
    PublishOptions,
    QueueSpec,
    Refused,
    ServerInfo,
    check_publish,
    count_settled,
    outgoing_headers,
)

__all__ = ["InMemoryBroker", "InMemoryHub"]


class InMemoryBroker:
    """One handle (like one connection) on an `InMemoryHub`; implements `broker.transport.Broker`.

    `user` plays the authenticated AMQP user: when set, a publish whose `user_id` differs is
    refused as RabbitMQ would. `hub=None` gives the handle a private hub. `stamp` is the user_id
    of publishes that name none; `meter` hears of every message sent, received and dead-lettered.
    """

    def __init__(
        self,
        hub: InMemoryHub | None = None,
        *,
        user: str | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        stamp: str | None = None,
        meter: Meter | None = None,
    ) -> None:
        self._hub = hub if hub is not None else InMemoryHub()
        self._session = self._hub.open_session()
        self._user = user
        self._max_message_bytes = max_message_bytes
        self.stamp = stamp
        self.meter = meter
        self._refused: list[Refused] = []

    @property
    def hub(self) -> InMemoryHub:
        return self._hub

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        self._hub.declare(self._session, queues)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        # `persistent` means nothing here: nothing outlives the process anyway.
        started = time.perf_counter()
        user_id = options.user_id or self.stamp
        target = f"exchange {exchange!r}, key {routing_key!r}"
        check_publish(body, self._max_message_bytes, user_id, self._user, target)
        headers = outgoing_headers(options.headers) or {}
        try:
            self._hub.publish(
                self._session, exchange, routing_key, body, headers, options.message_id, user_id
            )
        except (BackPressureError, UnroutableError) as exc:
            if not options.confirm_later:
                raise
            self._refused.append(Refused(exchange, routing_key, body, options, exc))
            return
        if self.meter is not None:
            self.meter.sent(routing_key, len(body), time.perf_counter() - started)

    def refused(self) -> list[Refused]:
        taken, self._refused = self._refused, []
        return taken

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        if prefetch < 1:
            raise ValueError(f"prefetch must be at least 1, got {prefetch}")
        self._hub.subscribe(self._session, queue, prefetch)

    def unsubscribe(self, queue: str) -> None:
        self._hub.unsubscribe(self._session, queue)

    def get(self, timeout: float) -> Delivery | None:
        if self.meter is None:
            return self._hub.next_delivery(self._session, timeout)
        started = time.perf_counter()
        delivery = self._hub.next_delivery(self._session, timeout)
        size = 0 if delivery is None else len(delivery.body)
        self.meter.received(size, time.perf_counter() - started)
        return delivery

    def ack(self, delivery: Delivery) -> None:
        self._hub.ack(self._session, delivery)

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        self._hub.nack(self._session, delivery, requeue)
        if not requeue and self.meter is not None:
            self.meter.dead_lettered(None)

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._hub.dead_letter(self._session, delivery, reason)
        if self.meter is not None:
            self.meter.dead_lettered(reason)

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        unsettled = self._hub.dead_letter_many(self._session, letters)
        if self.meter is not None:
            count_settled(self.meter, letters, unsettled)
        return unsettled

    def queue_depth(self, queue: str) -> int:
        return self._hub.queue_depth(self._session, queue)

    def delete_queue(self, queue: str) -> None:
        self._hub.delete_queue(self._session, queue)

    def close(self) -> None:
        self._hub.close(self._session)

    def server_info(self) -> ServerInfo:
        """Always healthy: the broker lives in this process."""
        return ServerInfo(
            product="SplitMQ in-memory broker",
            version="1",
            can_declare=True,
            can_publish=True,
            max_message_bytes=self._max_message_bytes,
        )

    def __enter__(self) -> InMemoryBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if TYPE_CHECKING:  # mypy proves the class satisfies the protocol

    def _conforms(broker: InMemoryBroker) -> Broker:
        return broker
