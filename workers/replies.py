"""Answers: GradientReplies (back-pressure waited out, a vanished client not fatal) and
dead letters with their reason.

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
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from broker.codec import encode
from broker.errors import BackPressureError, EncodeError, MessageTooLargeError, UnroutableError
from broker.messages import Error, GradientReply, InferReply, SmashedBatch, new_message_id
from broker.rejection import Rejected, dead_letter_safely
from broker.topology import REPLIES_EXCHANGE, reply_routing_key
from broker.transport import Broker, Delivery, PublishOptions

Answer = GradientReply | InferReply | Error


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

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def resend(self, job: str, client: str, seq: int) -> bool | None:
        """Send the reply last sent to `client` again, under a new message id, if it answers
        `seq`: whether it went out; None when no such reply is kept (another worker applied
        the batch, or the client has been answered for a later seq since)."""
        kept = self._last.get((job, client))
        if kept is None or kept.seq != seq:
            return None
        return self.send(replace(kept, message_id=new_message_id()))

    def send(self, reply: GradientReply) -> bool:
        """True once sent (a refusal of it comes back later: `_settle`); False when it cannot
        be delivered at all."""
        if reply.status == "ok":
            self._remember(reply)
        self._settle()
        # Not waiting for the confirm: the wait is a round trip to RabbitMQ on the job's
        # critical path for every step (docs/benchmarks.md); a refusal comes back later.
        return self.publish(reply, reply_routing_key(reply.job, reply.client), later=True)

    def publish(self, message: Answer, routing_key: str, *, later: bool = False) -> bool:
        """`message` on the replies exchange under `routing_key` (also split inference's);
        `later`: without waiting for its confirm."""
        try:
            body = encode(message)
        except EncodeError as exc:
            self._logger.error("%s cannot be encoded: %s", _what(message), exc)
            return False
        options = PublishOptions(message.message_id, persistent=False, confirm_later=later)
        return self._deliver(lambda: _what(message), routing_key, body, options)

    def _settle(self) -> None:
        """Refusals of earlier replies: a full queue is waited out, confirmed this time; a gone
        client or connection is only logged (the client republishes a batch whose reply it
        missed, and `resend` answers it)."""
        for refused in self._broker.refused():
            key = refused.routing_key
            if isinstance(refused.error, BackPressureError):
                options = replace(refused.options, confirm_later=False)
                what = partial(str, f"the reply published to {key}")
                self._deliver(what, key, refused.body, options)
            else:
                self._logger.warning(
                    "the reply published to %s was not delivered: %s", key, refused.error
                )

    def _deliver(
        self, what: Callable[[], str], routing_key: str, body: bytes, options: PublishOptions
    ) -> bool:
        # `what` names the message for a log line: built only when one is written, not for
        # every reply on the worker's critical path.
        delay = self._first_delay_s
        attempts = 0
        while True:
            try:
                # Transient: a gradient only matters to its client while that client waits
                # for it; persisting it cost RabbitMQ a disk write and the worker (whose
                # loop is the job's critical path) the wait for it (docs/benchmarks.md,
                # "SFL-V2 throughput").
                self._broker.publish(REPLIES_EXCHANGE, routing_key, body, options)
                return True
            except BackPressureError:
                attempts += 1
                # The client's own reply queue is full: keep trying, it only grows that way
                # when the client is slow, and dropping the reply would leave it waiting. A
                # stopping worker gives up after a few tries (the client will republish).
                if self._stop.is_set() and attempts >= 3:
                    self._logger.warning("%s dropped: full while stopping", what())
                    return False
                self._sleep(delay)
                delay = min(delay * 2, self._max_delay_s)
            except UnroutableError:
                self._logger.warning("%s unroutable: the client's queue is gone", what())
                return False
            except MessageTooLargeError as exc:
                self._logger.error("%s too large: %s", what(), exc)
                return False

    def _remember(self, reply: GradientReply) -> None:
        key = (reply.job, reply.client)
        self._last[key] = reply
        self._last.move_to_end(key)
        while len(self._last) > self._keep:
            self._last.popitem(last=False)


def _what(message: Answer) -> str:
    return f"{type(message).__name__} to job {message.job} client {message.client}"


def empty_reply(batch: SmashedBatch, version: int, status: str, reason: str) -> GradientReply:
    """A reply without a gradient: "gone" (a duplicate), "rejected" (too stale)."""
    return GradientReply(
        job=batch.job,
        client=batch.client,
        message_id=new_message_id(),
        version=version,
        seq=batch.seq,
        status=status,
        loss=0.0,
        correct=0,
        samples=0,
        grad=None,
        reason=reason,
    )


def reject(
    broker: Broker,
    delivery: Delivery,
    code: str,
    detail: str,
    counts: Counter[str],
    logger: logging.Logger,
) -> None:
    """Dead-letter `delivery` with reason `"<code>: <detail>"` and count it under `code`."""
    reason = f"{code}: {detail}"
    # A full dead-letter queue: RabbitMQ's own dead-lettering still moves it there (or drops
    # it), without our reason header; a poison message is never requeued.
    if dead_letter_safely(broker, delivery, reason) is Rejected.REDELIVERED:
        # Its connection is gone: it will be redelivered and rejected again then.
        logger.info("dead-letter of a stale delivery from %s skipped (%s)", delivery.queue, reason)
        return
    counts[code] += 1
    logger.warning("dead-lettered a message from %s: %s", delivery.queue, reason)
