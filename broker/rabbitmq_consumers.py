"""A RabbitMQ handle's consumer channel: the subscriptions on it, their deliveries, and the
single-active-consumer queues waiting to be taken over.

Whenever the consumer channel goes, everything delivered on it is void (RabbitMQ requeues it):
the generation is bumped and `on_void` tells the owner to drop its buffered and unacked state.
A new channel gets back every subscription (`open`). Nothing here runs per message: pika hands
each delivery to the owner's `on_message`.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import pika.exceptions

_log = logging.getLogger("splitmq.broker")
# How often a subscription waiting to take over a single-active-consumer queue looks again.
_LOOK_EVERY_S = 0.2
# Whether someone consumes a single-active-consumer queue now (`ChannelKeeper._taken_over`).
TakenOver = Callable[[str], bool]
# pika's delivery callback, given first the generation and queue it was subscribed with: the
# owner's (`RabbitMQBroker._on_message`), where each delivery becomes ours, and is dropped
# when its generation is void.
OnMessage = Callable[[int, str, Any, Any, Any, bytes], None]


class Consumers:
    """The consumer channel of the moment (pika's BlockingChannel, None before the first and
    after a loss), and what to consume on each new one. pika errors are the caller's to map."""

    def __init__(
        self,
        *,
        on_message: OnMessage,
        on_void: Callable[[], None],
        clock: Callable[[], float],
    ) -> None:
        self._on_message = on_message
        self._on_void = on_void
        self._clock = clock
        self.channel: Any = None
        self.generation = 0  # carried by deliveries; bumped when older ones become void
        self._prefetch: dict[str, int] = {}  # subscriptions to restore
        # Single-active-consumer subscriptions waiting for the queue's previous consumer to
        # go (`wait`), and when `look` last looked; `RabbitMQBroker.get` pumps without `look`
        # while none waits.
        self.waiting: dict[str, int] = {}
        self._looked_at = 0.0
        self._tags: dict[str, str] = {}  # queue -> consumer tag on the current channel

    def subscribed(self, queue: str) -> bool:
        return queue in self._prefetch or queue in self.waiting

    def live_channel(self, generation: int) -> Any:
        """The consumer channel, if deliveries of `generation` can still be settled on it."""
        if generation != self.generation or self.channel is None:
            return None
        return self.channel

    def open(self, connection: Any, taken_over: TakenOver) -> Any:
        """The consumer channel; a new one on `connection`, with every subscription back on
        it, if the last one went."""
        channel = self.channel
        if channel is None or not channel.is_open:
            self.void()
            channel = connection.channel()
            channel.add_on_cancel_callback(self._on_cancelled)
            self.channel = channel
            for queue, prefetch in list(self._prefetch.items()):
                try:
                    if taken_over(queue):  # our old consumer may linger a moment
                        del self._prefetch[queue]
                        self.waiting[queue] = prefetch
                    else:
                        self.consume(channel, queue, prefetch)
                except pika.exceptions.ChannelClosedByBroker:
                    del self._prefetch[queue]  # gone for good (deleted elsewhere): stop restoring
                    raise
        return channel

    def consume(self, channel: Any, queue: str, prefetch: int) -> None:
        # Per-consumer prefetch (global_qos=False): applies to the consumer created next.
        channel.basic_qos(prefetch_count=prefetch)
        on_message = functools.partial(self._on_message, self.generation, queue)
        self._tags[queue] = channel.basic_consume(queue, on_message, auto_ack=False)
        self._prefetch[queue] = prefetch  # restored on every new consumer channel

    def wait(self, queue: str, prefetch: int) -> None:
        """Consume `queue` once `look` finds its present consumer gone."""
        self.waiting[queue] = prefetch
        _log.info("waiting for the consumer of %s to go before taking it over", queue)

    def look(self, channel: Any, taken_over: TakenOver, time_limit: float) -> float:
        """Consume the waiting queues no one consumes any more (every `_LOOK_EVERY_S`); the
        time to wait for I/O, cut to wake up for the next look while any still waits."""
        if self.waiting and self._clock() - self._looked_at >= _LOOK_EVERY_S:
            self._looked_at = self._clock()
            for queue, prefetch in list(self.waiting.items()):
                if not taken_over(queue):
                    del self.waiting[queue]
                    self.consume(channel, queue, prefetch)
        if self.waiting:
            # Wake up for the next look, not only for I/O: nothing is delivered from a queue
            # not consumed yet, so a wait past the look would last its whole time limit.
            next_look = self._looked_at + _LOOK_EVERY_S - self._clock()
            time_limit = min(time_limit, max(0.0, next_look))
        return time_limit

    def stop(self, queue: str) -> bool:
        """Stop restoring `queue`; False if it was only waiting (never consumed)."""
        self._prefetch.pop(queue, None)
        return self.waiting.pop(queue, None) is None

    def cancel(self, channel: Any, queue: str) -> bool:
        """Cancel the consumer of `queue` on `channel`; False if the channel has none (it was
        replaced since)."""
        tag = self._tags.pop(queue, None)
        if tag is None:
            return False
        # pika requeues the deliveries that had not yet reached our callback.
        channel.basic_cancel(tag)
        return True

    def drop(self, queue: str) -> None:
        """Stop consuming `queue` by closing the consumer channel: RabbitMQ then gives back
        what the channel held and removes its consumers in one step, so a successor on a
        single-active-consumer queue finds the returned messages first. Everything delivered
        on the channel is void; the other subscriptions come back on the next channel."""
        self._prefetch.pop(queue, None)
        self.waiting.pop(queue, None)
        channel = self.channel
        self.void()
        if channel is not None and channel.is_open:
            _close_without_cancel(channel)

    def void(self) -> None:
        """The channel went (or is given up): its deliveries can no longer be settled."""
        self.channel = None
        self._tags.clear()
        self.generation += 1
        self._on_void()

    def _on_cancelled(self, method_frame: Any) -> None:
        # RabbitMQ cancelled a consumer (its queue was deleted): do not restore it later.
        tag = method_frame.method.consumer_tag
        for queue, known in list(self._tags.items()):
            if known == tag:
                del self._tags[queue]
                self._prefetch.pop(queue, None)


def _close_without_cancel(channel: Any) -> None:
    """Close a BlockingChannel as pika's `close` does, but without its basic.cancel of each
    consumer first (and nack of what pika had not yet handed out): that cancel is exactly
    the hand-over `Consumers.drop` must avoid. Relies on pika's private `_impl`,
    `_flush_output` and `_cleanup`; a pika whose internals differ gets its own close (then a
    successor may see the returned messages after newer ones)."""
    impl, flush, cleanup = (
        getattr(channel, n, None) for n in ("_impl", "_flush_output", "_cleanup")
    )
    if impl is None or not callable(flush) or not callable(cleanup):
        channel.close()
        return
    impl.close(reply_code=200, reply_text="Normal shutdown")
    try:
        flush(lambda: channel.is_closed)
    finally:
        cleanup()
