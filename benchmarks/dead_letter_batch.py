"""Per-message cost of `Broker.dead_letter` against `Broker.dead_letter_many` over RabbitMQ.

    python -m benchmarks.dead_letter_batch [--url amqp://...] [--messages 480] [--body 2048]

Publishes junk to a job's control queue, consumes it and dead-letters it one at a time (a
confirmed copy each) and then in batches of 1, 4, 16 and 64 (one transaction each), and prints
milliseconds per message for each way; then deletes its queues. What `services.aggregator`
pays per message refused over a sender's budget.
"""

from __future__ import annotations

import argparse
import time
import uuid

from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.topology import CONTROL_EXCHANGE, control_queue, dead_queue
from broker.transport import Delivery


def run(url: str, messages: int, body: bytes) -> None:
    job = f"bench{uuid.uuid4().hex[:8]}"
    dead, control = dead_queue(job), control_queue(job)
    broker = RabbitMQBroker(url, RabbitMQOptions(connection_name=f"{job}-bench"))
    try:
        broker.declare([dead, control])
        broker.subscribe(control.name, prefetch=64)
        for batch in (0, 1, 4, 16, 64):  # 0: dead_letter, one by one
            for _ in range(messages):
                broker.publish(CONTROL_EXCHANGE, control.routing_key, body)
            spent = 0.0
            left = messages
            while left:
                deliveries: list[Delivery] = []
                while len(deliveries) < min(batch or 1, left):
                    delivery = broker.get(5.0)
                    assert delivery is not None, "the benchmark's messages went missing"
                    deliveries.append(delivery)
                started = time.perf_counter()
                if batch:
                    unsettled = broker.dead_letter_many([(d, "bench: junk") for d in deliveries])
                    assert not unsettled, unsettled
                else:
                    broker.dead_letter(deliveries[0], "bench: junk")
                spent += time.perf_counter() - started
                left -= len(deliveries)
            way = f"dead_letter_many x{batch}" if batch else "dead_letter"
            print(f"{way:22s} {spent / messages * 1000:6.3f} ms a message ({messages} messages)")
    finally:
        broker.delete_queue(control.name)
        broker.delete_queue(dead.name)
        broker.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--messages", type=int, default=480)
    parser.add_argument("--body", type=int, default=2048, help="bytes per message")
    args = parser.parse_args()
    run(args.url, args.messages, b"\x00" * args.body)


if __name__ == "__main__":
    main()
