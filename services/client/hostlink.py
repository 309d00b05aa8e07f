"""A client host's connections, shared by all its clients (docs/architecture.md, "Client
hosts"): one consumer of the host's reply queue that hands each delivery to its client's
inbox (`Dispatcher`), and a few publishing handles any client thread borrows (`Publishers`),
which also carry the host's batched heartbeat (services/client/hostbeat.py). Each client sees
its share as a `Broker` (`SeatBroker`), so its loop (services/client/client.py) is the
standalone client's.

A pika connection is not thread-safe: the dispatcher's handle is used by its thread only
(clients' acks and dead letters are queued to it), and a publishing handle by one thread at a
time.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from broker.codec import decode
from broker.errors import BrokerError, DecodeError
from broker.rejection import Rejected, dead_letter_safely
from broker.transport import (
    PLAIN,
    Broker,
    Delivery,
    PublishOptions,
    QueueSpec,
    Refused,
    ServerInfo,
)
from services.client.errors import ClientStopped

# How long the dispatcher waits for a delivery before it settles what clients queued.
_SETTLE_EVERY_S = 0.02


class Inbox:
    """One online client's deliveries, in arrival order."""

    def __init__(self) -> None:
        self._items: deque[Delivery] = deque()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, delivery: Delivery) -> bool:
        """False when the client went offline meanwhile (the caller drops the delivery)."""
        with self._ready:
            if self._closed:
                return False
            self._items.append(delivery)
            self._ready.notify()
            return True

    def get(self, timeout: float) -> Delivery | None:
        with self._ready:
            if not self._items and not self._closed:
                self._ready.wait(timeout)
            return self._items.popleft() if self._items else None

    def close(self) -> list[Delivery]:
        """Stop taking deliveries; the ones not taken yet."""
        with self._ready:
            self._closed = True
            left = list(self._items)
            self._items.clear()
            self._ready.notify_all()
            return left

    def __len__(self) -> int:
        return len(self._items)


@dataclass
class DispatchStats:
    """Counters of the dispatcher's thread (read them after it stopped, or as estimates)."""

    routed: int = 0
    offline_dropped: int = 0  # for a client of this host that is offline now
    dead_lettered: int = 0  # not decodable, or not for a client of this host


class Dispatcher:
    """Consumes the host's reply queue on its own thread and routes each delivery, by the
    client it names, to that client's inbox. A delivery for a client of this host that is
    offline is acked and dropped: the device is off, as a standalone client's process would
    be gone (its replies answer requests of a process that no longer exists; its next session
    joins afresh). Anything else on the queue is dead-lettered with the reason."""

    def __init__(
        self,
        broker: Broker,
        spec: QueueSpec,
        *,
        owns: Callable[[str], bool],
        prefetch: int,
        logger: logging.Logger,
    ) -> None:
        self._broker = broker
        self._spec = spec
        self._owns = owns
        self._prefetch = prefetch
        self._log = logger
        self._inboxes: dict[str, Inbox] = {}
        self._lock = threading.Lock()
        # (delivery, reason): reason None acks. Appended by client threads, settled here.
        self._settle: deque[tuple[Delivery, str | None]] = deque()
        self.stats = DispatchStats()

    def open(self) -> None:
        self._broker.declare([self._spec])
        self._broker.subscribe(self._spec.name, prefetch=self._prefetch)

    def attach(self, client: str) -> Inbox:
        inbox = Inbox()
        with self._lock:
            self._inboxes[client] = inbox
        return inbox

    def detach(self, client: str) -> None:
        with self._lock:
            inbox = self._inboxes.pop(client, None)
        if inbox is not None:
            for delivery in inbox.close():
                self.settle(delivery, None)
                self.stats.offline_dropped += 1

    def settle(self, delivery: Delivery, reason: str | None) -> None:
        """Ack (`reason` None) or dead-letter a delivery, from any thread."""
        self._settle.append((delivery, reason))

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            delivery = self._broker.get(_SETTLE_EVERY_S)
            if delivery is not None:
                self._route(delivery)
            self._settle_queued()
        self._settle_queued()

    def _route(self, delivery: Delivery) -> None:
        try:
            client = decode(delivery.body).client
        except DecodeError as exc:
            self._dead_letter(delivery, f"undecodable: {exc.reason}")
            return
        with self._lock:
            inbox = self._inboxes.get(client)
        if inbox is not None and inbox.put(delivery):
            self.stats.routed += 1
        elif self._owns(client):
            self.stats.offline_dropped += 1
            self._ack(delivery)
        else:
            self._dead_letter(delivery, f"for client {client[:80]!r}, not one of this host's")

    def _settle_queued(self) -> None:
        while self._settle:
            delivery, reason = self._settle.popleft()
            if reason is None:
                self._ack(delivery)
            else:
                self._dead_letter(delivery, reason)

    def _ack(self, delivery: Delivery) -> None:
        # A delivery of a lost connection comes back and is routed again.
        with contextlib.suppress(BrokerError):
            self._broker.ack(delivery)

    def _dead_letter(self, delivery: Delivery, reason: str) -> None:
        if dead_letter_safely(self._broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self.stats.dead_lettered += 1
        self._log.warning("dead-lettering a reply on the host queue: %s", reason)


class Publishers:
    """A few broker handles that client threads publish through, one thread per handle at a
    time; `keep_alive` services the ones no publish used lately (AMQP heartbeats are only
    answered while a handle is called)."""

    def __init__(self, handles: Sequence[Broker]) -> None:
        self._handles = list(handles)
        self._free: queue.SimpleQueue[Broker] = queue.SimpleQueue()
        self._used: dict[int, float] = {}
        for handle in self._handles:
            self._free.put(handle)

    @contextlib.contextmanager
    def handle(self) -> Iterator[Broker]:
        broker = self._free.get()
        try:
            yield broker
        finally:
            self._used[id(broker)] = time.monotonic()
            self._free.put(broker)

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions
    ) -> None:
        with self.handle() as broker:
            broker.publish(exchange, routing_key, body, options)

    def keep_alive(self, idle_s: float, probe: str) -> None:
        """One cheap call (the depth of queue `probe`) on each handle idle for `idle_s`."""
        now = time.monotonic()
        for handle in self._handles:
            if now - self._used.get(id(handle), 0.0) >= idle_s:
                with self.handle() as broker:
                    broker.queue_depth(probe)


class SeatBroker:
    """One client's view of its host's connections, as a `Broker`: deliveries from its inbox,
    publishes through the shared handles. Once its client is offline (`unplug`) it sends
    nothing: a publish raises `ClientStopped`, as the stop that goes with going offline would."""

    def __init__(self, client: str, dispatcher: Dispatcher, publishers: Publishers) -> None:
        self._client = client
        self._dispatcher = dispatcher
        self._publishers = publishers
        self._inbox = dispatcher.attach(client)
        self._online = True

    def unplug(self) -> None:
        self._online = False
        self._dispatcher.detach(self._client)

    def declare(self, queues: Sequence[QueueSpec]) -> None:
        raise BrokerError("a client host's client declares nothing: the host owns its queues")

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        if not self._online:
            raise ClientStopped(f"client {self._client} is offline")
        self._publishers.publish(exchange, routing_key, body, options)

    def refused(self) -> list[Refused]:
        return []  # it never publishes with confirm_later

    def subscribe(self, queue: str, *, prefetch: int) -> None:
        raise BrokerError("a client host's client subscribes to nothing: its host routes to it")

    def unsubscribe(self, queue: str) -> None:
        pass

    def get(self, timeout: float) -> Delivery | None:
        return self._inbox.get(timeout)

    def ack(self, delivery: Delivery) -> None:
        self._dispatcher.settle(delivery, None)

    def nack(self, delivery: Delivery, *, requeue: bool) -> None:
        raise BrokerError("a client host's client dead-letters with a reason, never nacks")

    def dead_letter(self, delivery: Delivery, reason: str) -> None:
        self._dispatcher.settle(delivery, reason)

    def dead_letter_many(
        self, letters: Sequence[tuple[Delivery, str]]
    ) -> list[tuple[Delivery, BrokerError]]:
        for delivery, reason in letters:
            self._dispatcher.settle(delivery, reason)
        return []

    def queue_depth(self, queue: str) -> int:
        return len(self._inbox)

    def delete_queue(self, queue: str) -> None:
        raise BrokerError("a client host's client deletes no queue")

    def server_info(self) -> ServerInfo:
        with self._publishers.handle() as broker:  # the host's connection is the seat's
            return broker.server_info()

    def close(self) -> None:
        self.unplug()
