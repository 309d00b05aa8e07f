"""What a RabbitMQ handle has declared: its exchanges and queues, with their x-arguments, to
declare again on every new publisher channel after a reconnect."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from broker.errors import BackPressureError
from broker.rabbitmq_connection import RabbitMQOptions
from broker.topology import DEAD_EXCHANGE, EXCHANGES
from broker.transport import QueueSpec


def queue_arguments(
    spec: QueueSpec, queue_type: str = "classic", delivery_limit: int = 20
) -> dict[str, Any]:
    """The x-arguments that give a declared queue the behaviour its spec asks for, as a
    `queue_type` queue (`RabbitMQOptions.queue_type`).

    A quorum queue must be durable and shared, so a private (exclusive or auto-delete) queue
    stays classic: it is gone with its connection anyway. A quorum queue that dead-letters does
    so at-least-once (RabbitMQ keeps the message until the dead-letter queue has confirmed it,
    so a node's death between the two loses nothing), which needs reject-publish overflow, and
    has a delivery limit, past which a message that kept coming back is dead-lettered.
    """
    args: dict[str, Any] = {}
    quorum = queue_type == "quorum" and spec.durable and not (spec.exclusive or spec.auto_delete)
    if quorum:
        args["x-queue-type"] = "quorum"
    if spec.single_active_consumer:
        args["x-single-active-consumer"] = True
    if spec.max_length is not None:
        args["x-max-length"] = spec.max_length
    if spec.max_length_bytes is not None:
        args["x-max-length-bytes"] = spec.max_length_bytes
    if spec.max_length is not None or spec.max_length_bytes is not None:
        args["x-overflow"] = spec.overflow
    if spec.dead_letter_routing_key is not None:
        args["x-dead-letter-exchange"] = DEAD_EXCHANGE
        args["x-dead-letter-routing-key"] = spec.dead_letter_routing_key
        if quorum:
            args["x-delivery-limit"] = delivery_limit
            if args.setdefault("x-overflow", "reject-publish") == "reject-publish":
                args["x-dead-letter-strategy"] = "at-least-once"
    return args


class Declarations:
    """The exchanges and queues declared through one handle, by name, on whatever channel
    the caller gives (pika channels; errors are pika's, for the caller to map)."""

    def __init__(self, options: RabbitMQOptions) -> None:
        self._options = options
        self._specs: dict[str, QueueSpec] = {}
        self._exchanges_declared = False

    @property
    def specs(self) -> Mapping[str, QueueSpec]:
        """The queues declared through this handle, by name."""
        return self._specs

    def declare_on(self, channel: Any, specs: Sequence[QueueSpec]) -> None:
        # Exchanges once per channel: `restore` declares them again on every new channel.
        if not self._exchanges_declared:
            self._declare_exchanges(channel)
        if self._options.passive_declare:
            # Without configure permission: the queues must exist (and be bound) already. The
            # specs are still recorded, so dead_letter knows each queue's routing.
            for spec in specs:
                channel.queue_declare(spec.name, passive=True)
                self._specs[spec.name] = spec
            return
        for spec in specs:
            channel.queue_declare(
                spec.name,
                durable=spec.durable,
                exclusive=spec.exclusive,
                auto_delete=spec.auto_delete,
                arguments=queue_arguments(
                    spec, self._options.queue_type, self._options.delivery_limit
                )
                or None,
            )
            channel.queue_bind(spec.name, spec.exchange, routing_key=spec.routing_key)
            self._specs[spec.name] = spec

    def restore(self, channel: Any) -> None:
        """Declare everything declared so far again on a new channel: after a reconnect the
        exclusive and auto-delete queues are gone, and a restarted server has lost the
        transient ones."""
        if self._exchanges_declared:
            self._declare_exchanges(channel)
            self.declare_on(channel, list(self._specs.values()))

    def forget(self, queue: str) -> None:
        self._specs.pop(queue, None)

    def full(self, exchange: str, routing_key: str) -> BackPressureError:
        """The error for a publish RabbitMQ nacked: a queue it routes to is full."""
        fanout = dict(EXCHANGES).get(exchange) == "fanout"
        names = [
            repr(spec.name)
            for spec in self._specs.values()
            if spec.exchange == exchange and (fanout or spec.routing_key == routing_key)
        ]
        return BackPressureError(
            f"RabbitMQ refused the message for exchange {exchange!r} key {routing_key!r}: "
            f"queue {', '.join(names) or '(not declared on this handle)'} is full "
            "(reject-publish); nothing was enqueued, retry later"
        )

    def _declare_exchanges(self, channel: Any) -> None:
        passive = self._options.passive_declare
        for name, kind in EXCHANGES:
            channel.exchange_declare(name, kind, durable=True, passive=passive)
        self._exchanges_declared = True
