"""A worker's replies: `Replier` sends them (GradientReplies, a U-shaped step's ServerOutputs,
split inference's answers) and keeps each client's last "ok" one for a copy of its batch;
`answer` builds the GradientReply to a batch; `reject` dead-letters a delivery at once (split
inference's server, which has no batch of refusals).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch

from broker.codec import encode
from broker.errors import BackPressureError, EncodeError, MessageTooLargeError, UnroutableError
from broker.messages import (
    Error,
    GradientReply,
    InferReply,
    ServerOutput,
    SmashedBatch,
    TailGradient,
    new_message_id,
)
from broker.rejection import Rejected, dead_letter_safely
from broker.topology import REPLIES_EXCHANGE, reply_routing_key
from broker.transport import Broker, Delivery, PublishOptions, Refused

# A reply refused by back-pressure is tried again after these, doubling.
_FIRST_DELAY_S = 0.05
_MAX_DELAY_S = 2.0
# Tries of a reply whose client's queue is full before it is dropped (docs/reliability.md).
_FULL_ATTEMPTS = 4

Answer = GradientReply | InferReply | ServerOutput | Error


class Replier:
    """The runner's reply step: sends replies (to a full reply queue a few times, then the
    reply is dropped: its client reads none), and keeps each client's last "ok" reply (by
    reference, at most `keep` clients) for `resend`: replies are
    transient, so a broker restart loses them, and a sequential client's last reply is the only
    one it can still be waiting for.
    """

    def __init__(
        self,
        broker: Broker,
        stop: threading.Event,
        logger: logging.Logger,
        *,
        sleep: Callable[[float], None] | None = None,
        keep: int = 1024,
    ) -> None:
        self._broker = broker
        self._stop = stop
        self._logger = logger
        # Waiting on the stop event, so a stopping worker does not sit out a long backoff.
        self._sleep = sleep or (lambda s: bool(stop.wait(s)))
        self._keep = max(1, keep)
        self._last: OrderedDict[tuple[str, str], GradientReply] = OrderedDict()
        # Each client's routing key, made once (per-batch work is the path issue 35 pins).
        self._keys: dict[tuple[str, str], str] = {}

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
        """True once sent (a refusal comes back later, to `_settle`); False if undeliverable."""
        key = (reply.job, reply.client)
        routing_key = self._keys.get(key)
        if routing_key is None:
            if len(self._keys) >= 4 * self._keep:
                self._keys.clear()
            routing_key = self._keys[key] = reply_routing_key(reply.job, reply.client)
        if reply.status == "ok":  # `_remember`, inline: every step's replies come here
            last = self._last
            last[key] = reply
            last.move_to_end(key)
            while len(last) > self._keep:
                last.popitem(last=False)
        if refused := self._broker.refused():
            self._settle(refused)
        # Not waiting for the confirm: the wait is a round trip to RabbitMQ on the job's
        # critical path for every step (docs/benchmarks.md); a refusal comes back later.
        return self.publish(reply, routing_key, later=True)

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

    def _settle(self, refusals: list[Refused]) -> None:
        """Refusals of earlier replies: a full queue is tried again, confirmed this time; a gone
        client or connection is only logged (the client republishes a batch whose reply it
        missed, and `resend` answers it)."""
        for refused in refusals:
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
        delay = _FIRST_DELAY_S
        attempts = 0
        while True:
            try:
                # Transient: a gradient only matters while its client waits; persisting it
                # costs a disk write on the job's critical path (docs/benchmarks.md, "SFL-V2
                # throughput").
                self._broker.publish(REPLIES_EXCHANGE, routing_key, body, options)
                return True
            except BackPressureError:
                attempts += 1
                # The client's own reply queue is at its bound, far above what a client that
                # reads its replies ever holds: it stopped reading, and waiting for it would
                # stall every client of the shard. A few short tries ride out a quorum queue's
                # overshoot; then the reply is dropped, and kept for `resend` should the client
                # come back and republish its batch.
                if attempts >= _FULL_ATTEMPTS:
                    self._logger.warning("%s dropped: the client's reply queue is full", what())
                    return False
                self._sleep(delay)
                delay = min(delay * 2, _MAX_DELAY_S)
            except UnroutableError:
                self._logger.warning("%s unroutable: the client's queue is gone", what())
                return False
            except MessageTooLargeError as exc:
                self._logger.error("%s too large: %s", what(), exc)
                return False


def _what(message: Answer) -> str:
    return f"{type(message).__name__} to job {message.job} client {message.client}"


def answer(
    batch: SmashedBatch | TailGradient,
    version: int,
    status: str,
    reason: str = "",
    *,
    loss: float = 0.0,
    correct: int = 0,
    grad: torch.Tensor | None = None,
) -> GradientReply:
    """The reply to `batch`: "ok" with its step's results; without a gradient, "gone" (a
    duplicate) or "rejected" (too stale)."""
    samples = 0
    if status == "ok" and isinstance(batch, SmashedBatch):
        samples = int(batch.activations.shape[0])
    return GradientReply(
        job=batch.job,
        client=batch.client,
        message_id=new_message_id(),
        version=version,
        seq=batch.seq,
        status=status,
        loss=loss,
        correct=correct,
        samples=samples,
        grad=grad,
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
