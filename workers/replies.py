"""Publishing GradientReplies: back-pressure is waited out, a vanished client is not fatal.

Replies are transient (see `Replier.send`): a broker restart drops the ones not consumed yet.
The client then publishes its batch again, and the worker, which applied it already, must not
apply it twice nor leave the client without its gradient: the Replier keeps the last "ok"
reply it sent each client and sends it again for a copy of that seq (`resend`). A sequential
client has one batch in flight, so its last reply is the only one it can still be waiting for;
the cache holds a reference to the reply the step built (no copy), one per client, at most
`keep` clients (the least recently answered go first).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace

from broker.codec import encode
from broker.errors import BackPressureError, EncodeError, MessageTooLargeError, UnroutableError
from broker.messages import GradientReply, new_message_id
from broker.topology import REPLIES_EXCHANGE, reply_routing_key
from broker.transport import Broker


class Replier:
    """Sends replies on one broker handle; retries `BackPressureError` with capped backoff."""

    def __init__(
        self,
        broker: Broker,
        stop: threading.Event,
        logger: logging.Logger,
        *,
        first_delay_s: float = 0.05,
        max_delay_s: float = 2.0,
        sleep: Callable[[float], None] | None = None,
        keep: int = 1024,
    ) -> None:
        self._broker = broker
        self._stop = stop
        self._logger = logger
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        # Waiting on the stop event, so a stopping worker does not sit out a long backoff.
        self._sleep = sleep or (lambda s: bool(stop.wait(s)))
        self._keep = max(1, keep)
        self._last: OrderedDict[tuple[str, str], GradientReply] = OrderedDict()

    def resend(self, job: str, client: str, seq: int) -> bool | None:
        """Send the reply last sent to `client` again, under a new message id, if it answers
        `seq`: whether it went out; None when no such reply is kept (another worker applied
        the batch, or the client has been answered for a later seq since)."""
        kept = self._last.get((job, client))
        if kept is None or kept.seq != seq:
            return None
        return self.send(replace(kept, message_id=new_message_id()))

    def send(self, reply: GradientReply) -> bool:
        """True once the broker confirmed it; False when it cannot be delivered at all."""
        if reply.status == "ok":
            self._remember(reply)
        what = f"job {reply.job} client {reply.client} seq {reply.seq}"
        try:
            body = encode(reply)
        except EncodeError as exc:
            self._logger.error("reply to %s cannot be encoded: %s", what, exc)
            return False
        delay = self._first_delay_s
        attempts = 0
        while True:
            try:
                # Transient: a gradient only matters to its client while that client waits
                # for it; persisting it cost RabbitMQ a disk write and the worker (whose
                # loop is the job's critical path) the wait for it: 7-8 ms of a ~20 ms cnn5
                # step, ~25% of SFL-V2 throughput (docs/benchmarks.md, "SFL-V2 throughput").
                self._broker.publish(
                    REPLIES_EXCHANGE,
                    reply_routing_key(reply.job, reply.client),
                    body,
                    message_id=reply.message_id,
                    persistent=False,
                )
                return True
            except BackPressureError:
                attempts += 1
                # The client's own reply queue is full: keep trying, it only grows that way
                # when the client is slow, and dropping the reply would leave it waiting. A
                # stopping worker gives up after a few tries (the client will republish).
                if self._stop.is_set() and attempts >= 3:
                    self._logger.warning("reply to %s dropped: queue full while stopping", what)
                    return False
                self._sleep(delay)
                delay = min(delay * 2, self._max_delay_s)
            except UnroutableError:
                self._logger.warning("reply to %s unroutable: the client's queue is gone", what)
                return False
            except MessageTooLargeError as exc:
                self._logger.error("reply to %s too large: %s", what, exc)
                return False

    def _remember(self, reply: GradientReply) -> None:
        key = (reply.job, reply.client)
        self._last[key] = reply
        self._last.move_to_end(key)
        while len(self._last) > self._keep:
            self._last.popitem(last=False)
