"""Publishes on a confirm-mode channel that nothing blocks on (`Unconfirmed`): a handle's
`confirm_later` publishes, and the copies of a batch of dead letters, which wait for all their
confirms at once."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika.spec

from broker.errors import BackPressureError, BrokerError, BrokerUnavailableError
from broker.topology import BEST_EFFORT_EXCHANGES
from broker.transport import PublishOptions, Refused, unroutable


@dataclass(eq=False)
class _Sent:
    """A publish awaiting its confirm; `error` is set by a basic.return."""

    order: int  # across channels: confirms of one channel may come out of order, too
    exchange: str
    routing_key: str
    body: bytes
    options: PublishOptions
    error: BrokerError | None = None

    def refused(self, error: BrokerError) -> tuple[int, Refused]:
        return self.order, Refused(self.exchange, self.routing_key, self.body, self.options, error)


class Unconfirmed:
    """A confirm-mode channel nothing blocks on: each publish is noted by its delivery tag,
    confirms and basic.returns only take notes, and `take` hands out the refusals in publish
    order. RabbitMQ confirms out of order (an unroutable message at once, a full queue's nack
    later), so a refusal is held back until every earlier publish is confirmed."""

    def __init__(self, full: Callable[[str, str], BackPressureError]) -> None:
        self._full = full
        self.channel: Any = None
        self.sent: dict[int, _Sent] = {}  # by delivery tag, unconfirmed
        # Lately confirmed: a late basic.return may still come in for them, as may a confirm
        # while `sent` is not empty (`RabbitMQBroker.refused` reads both).
        self.acked: deque[_Sent] = deque(maxlen=64)
        self._next_tag = 1
        self.refusals: list[tuple[int, Refused]] = []  # (order, refusal), not yet taken
        self._sends = 0  # publishes so far, for their order

    def open(self, connection: Any) -> Any:
        channel = self.channel
        if channel is None or not channel.is_open:
            self.lose("its channel closed before the confirm")
            channel = connection.channel()
            # pika's BlockingChannel would wait for every confirm: confirms go to the
            # underlying channel, to callbacks that only take notes (nowait select).
            channel._impl.confirm_delivery(ack_nack_callback=self._on_confirm)
            channel._impl.add_on_return_callback(self._on_return)
            self.channel, self._next_tag = channel, 1
        return channel

    def send(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        options: PublishOptions,
    ) -> int:
        """Write one publish on the open channel; its order, which `take` reports."""
        mandatory = exchange not in BEST_EFFORT_EXCHANGES
        # Noted first: writing the frames takes in what RabbitMQ sent meanwhile, and its
        # basic.return and confirm of this very message may be among it.
        tag, order = self._next_tag, self._sends
        self.sent[tag] = _Sent(order, exchange, routing_key, body, options)
        try:
            # Not in BlockingChannel's confirm mode, so this only writes the frames.
            self.channel.basic_publish(exchange, routing_key, body, properties, mandatory=mandatory)
        except BaseException:
            self.sent.pop(tag, None)
            raise
        self._next_tag += 1
        self._sends += 1
        return order

    def take(self) -> list[tuple[int, Refused]]:
        """The refusals since the last call, with their orders, in publish order."""
        taken = sorted(self.refusals, key=lambda pair: pair[0])
        first_open = min((sent.order for sent in self.sent.values()), default=self._sends)
        self.refusals = [pair for pair in taken if pair[0] > first_open]
        return [pair for pair in taken if pair[0] < first_open]

    def lose(self, why: str) -> None:
        """Every unconfirmed publish is refused, with `why` (the channel or connection went)."""
        for sent in self.sent.values():
            error = BrokerUnavailableError(f"publish to {sent.routing_key!r}: {why}")
            self.refusals.append(sent.refused(sent.error or error))
        self.sent.clear()

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        tags = [t for t in self.sent if t <= method.delivery_tag] if method.multiple else []
        for tag in tags or [method.delivery_tag]:
            sent = self.sent.pop(tag, None)
            if sent is None:
                continue
            if isinstance(method, pika.spec.Basic.Nack):
                sent.error = self._full(sent.exchange, sent.routing_key)
            if sent.error is not None:
                self.refusals.append(sent.refused(sent.error))
            else:
                self.acked.append(sent)

    def _on_return(self, _channel: Any, method: Any, _props: Any, body: bytes) -> None:
        # A basic.return is sent before the confirm of the message it hands back, but now and
        # then it is read after it: then the message is among the lately confirmed.
        for sent in [*self.sent.values(), *self.acked]:
            if sent.error is None and sent.routing_key == method.routing_key and sent.body == body:
                sent.error = unroutable(sent.exchange, sent.routing_key)
                if sent in self.acked:
                    self.acked.remove(sent)
                    self.refusals.append(sent.refused(sent.error))
                return
