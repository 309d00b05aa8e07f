"""What the coordinator and the aggregator send: replies to clients, shard markers, events.

One `Outbox` wraps one broker handle (so it belongs to the thread that opened the handle) and
knows the job's routing keys; callers deal in messages, not exchanges.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from broker.codec import encode
from broker.errors import BackPressureError, UnroutableError
from broker.messages import ConfigValue, Error, Event, Message, new_message_id
from broker.topology import (
    EVENTS_EXCHANGE,
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    reply_routing_key,
    shard_routing_key,
)
from broker.transport import Broker, PublishOptions

# Back-pressure on a shard queue clears as its worker drains it; retry at this pace.
_RETRY_S = (0.05, 0.1, 0.2, 0.5, 1.0)


class Outbox:
    def __init__(self, broker: Broker, job: str, logger: logging.Logger) -> None:
        self._broker = broker
        self._job = job
        self._log = logger

    def reply(self, client: str, message: Message) -> int:
        """Send to `client`'s reply queue; the encoded size. Raises `UnroutableError` when the
        client cannot be reached: it has no reply queue (it never declared one, or it is gone),
        or its queue is at its bound. A full reply queue is the same fate told another way: its
        client reads none of its replies, and waiting for it would let one client that stopped
        reading stall the role that answers everyone (docs/architecture.md, reply bounds)."""
        body = encode(message)
        try:
            self._broker.publish(
                REPLIES_EXCHANGE,
                reply_routing_key(self._job, client),
                body,
                PublishOptions(message_id=message.message_id),
            )
        except BackPressureError as exc:
            raise UnroutableError(f"reply queue of client {client!r} is full: {exc}") from None
        return len(body)

    def error(self, client: str, version: int, code: str, reason: str, ref: str = "") -> bool:
        """Best effort: an error for a client that cannot be reached is only logged (False)."""
        message = Error(self._job, client, new_message_id(), version, code, reason, ref)
        try:
            self.reply(client, message)
        except UnroutableError as exc:
            args = (self._job, code, client, exc)
            self._log.warning("job %s: cannot send error %r to client %s: %s", *args)
            return False
        return True

    def to_shard(self, shard: int, message: Message, stop: threading.Event) -> bool:
        """Publish on a shard queue, waiting out back-pressure; False if `stop` came first."""
        body = encode(message)
        attempt = 0
        while True:
            try:
                self._broker.publish(
                    SMASHED_EXCHANGE,
                    shard_routing_key(self._job, shard),
                    body,
                    PublishOptions(message_id=message.message_id),
                )
                return True
            except BackPressureError:
                delay = _RETRY_S[min(attempt, len(_RETRY_S) - 1)]
                attempt += 1
                self._log.info("job %s: shard %d queue is full; retrying", self._job, shard)
                if stop.wait(delay):
                    return False

    def event(
        self, kind: str, version: int, data: Mapping[str, ConfigValue], client: str = ""
    ) -> None:
        """Fanout notice; nobody listening is normal, so an unroutable event is dropped."""
        message = Event(self._job, client, new_message_id(), version, kind, dict(data))
        try:
            body = encode(message)
            self._broker.publish(EVENTS_EXCHANGE, "", body, PublishOptions(message.message_id))
        except UnroutableError:
            self._log.debug("job %s: event %s has no subscriber", self._job, kind)
