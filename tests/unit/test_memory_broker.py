"""In-memory broker behaviour beyond the shared contract: threads, join, exclusive queues."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import pytest

from broker.errors import BackPressureError, BrokerError
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.topology import (
    CONTROL_EXCHANGE,
    DEAD_EXCHANGE,
    EVENTS_EXCHANGE,
    control_queue,
    dead_queue,
)
from broker.transport import QueueSpec


def drained(hub: InMemoryHub, timeout: float, queues: Iterable[str] | None = None) -> bool:
    """Wait until the queues (by default all but the dead-letter queues, which only operators
    drain) hold nothing ready or unacknowledged; False on timeout."""
    names = None if queues is None else set(queues)
    deadline = time.monotonic() + timeout
    while True:
        with hub.lock:
            watched = [
                q
                for q in hub.queues.values()
                if (q.spec.exchange != DEAD_EXCHANGE if names is None else q.spec.name in names)
            ]
            if not any(q.ready or any(c.in_flight for c in q.consumers) for q in watched):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)


def spec(name: str, exchange: str = CONTROL_EXCHANGE, **options: Any) -> QueueSpec:
    return QueueSpec(name=name, exchange=exchange, routing_key=name, **options)


def test_handles_on_many_threads_deliver_each_message_once() -> None:
    hub = InMemoryHub()
    queue = spec("work")
    InMemoryBroker(hub).declare([queue])
    received: list[bytes] = []
    received_lock = threading.Lock()
    stop = threading.Event()

    def produce(worker: int) -> None:
        with InMemoryBroker(hub) as broker:
            for index in range(50):
                broker.publish(CONTROL_EXCHANGE, queue.routing_key, f"{worker}:{index}".encode())

    def consume() -> None:
        with InMemoryBroker(hub) as broker:
            broker.subscribe(queue.name, prefetch=4)
            while not stop.is_set():
                delivery = broker.get(0.05)
                if delivery is not None:
                    with received_lock:
                        received.append(delivery.body)
                    broker.ack(delivery)

    consumers = [threading.Thread(target=consume) for _ in range(2)]
    producers = [threading.Thread(target=produce, args=(w,)) for w in range(4)]
    for thread in consumers + producers:
        thread.start()
    for thread in producers:
        thread.join()
    emptied = drained(hub, 10)
    stop.set()
    for thread in consumers:
        thread.join()

    assert emptied
    expected = sorted(f"{w}:{i}".encode() for w in range(4) for i in range(50))
    assert sorted(received) == expected


def test_join_waits_for_acks_and_ignores_dead_letter_queues() -> None:
    hub = InMemoryHub()
    broker = InMemoryBroker(hub)
    dead, control = dead_queue("j"), control_queue("j")
    broker.declare([dead, control])
    broker.publish(CONTROL_EXCHANGE, control.routing_key, b"bad")
    broker.publish(CONTROL_EXCHANGE, control.routing_key, b"good")
    broker.subscribe(control.name, prefetch=2)
    bad, good = broker.get(1), broker.get(1)
    assert bad is not None and good is not None

    broker.dead_letter(bad, "malformed")
    assert not drained(hub, 0.05)  # "good" is still unacknowledged
    broker.ack(good)

    assert drained(hub, 1)  # the dead-letter queue holds one message, and does not count
    assert broker.queue_depth(dead.name) == 1
    assert not drained(hub, 0.05, queues=[dead.name])


def test_exclusive_queue_belongs_to_its_handle_and_dies_with_it() -> None:
    hub = InMemoryHub()
    owner, other = InMemoryBroker(hub), InMemoryBroker(hub)
    private = spec("private", durable=False, exclusive=True)
    owner.declare([private])

    with pytest.raises(BrokerError, match="RESOURCE_LOCKED"):
        other.subscribe(private.name, prefetch=1)
    other.publish(CONTROL_EXCHANGE, private.routing_key, b"anyone may publish")
    assert owner.queue_depth(private.name) == 1

    owner.close()
    with pytest.raises(BrokerError, match="no queue"):
        other.queue_depth(private.name)


def test_auto_delete_queue_goes_with_its_last_consumer() -> None:
    broker = InMemoryBroker()
    temporary = spec("temporary", auto_delete=True)
    broker.declare([temporary])
    broker.subscribe(temporary.name, prefetch=1)

    broker.unsubscribe(temporary.name)

    with pytest.raises(BrokerError, match="no queue"):
        broker.queue_depth(temporary.name)


def test_fanout_with_one_full_queue_delivers_to_the_others_and_pushes_back() -> None:
    broker = InMemoryBroker()
    roomy = spec("roomy", exchange=EVENTS_EXCHANGE)
    tight = spec("tight", exchange=EVENTS_EXCHANGE, max_length=1)
    broker.declare([roomy, tight])
    broker.publish(EVENTS_EXCHANGE, "", b"first")

    with pytest.raises(BackPressureError, match="tight"):
        broker.publish(EVENTS_EXCHANGE, "", b"second")

    assert (broker.queue_depth(roomy.name), broker.queue_depth(tight.name)) == (2, 1)


def test_prefetch_must_be_positive() -> None:
    broker = InMemoryBroker()
    broker.declare([spec("work")])

    with pytest.raises(ValueError, match="prefetch"):
        broker.subscribe("work", prefetch=0)


def test_returned_messages_go_back_to_their_publish_position() -> None:
    hub = InMemoryHub()
    first, second, last = InMemoryBroker(hub), InMemoryBroker(hub), InMemoryBroker(hub)
    queue = spec("work")
    first.declare([queue])
    for index in range(4):
        first.publish(CONTROL_EXCHANGE, queue.routing_key, f"m{index}".encode())
    first.subscribe(queue.name, prefetch=2)
    held_first = [first.get(1), first.get(1)]
    second.subscribe(queue.name, prefetch=1)
    held_second = second.get(1)

    first.close()  # m0, m1 return ahead of m3, while m2 is still out
    second.close()  # m2 must slot in between them, not at the head or the tail
    last.subscribe(queue.name, prefetch=4)
    bodies = [d.body for d in (last.get(1) for _ in range(4)) if d is not None]

    assert [d.body for d in held_first if d] == [b"m0", b"m1"]
    assert held_second is not None and held_second.body == b"m2"
    assert bodies == [b"m0", b"m1", b"m2", b"m3"]
