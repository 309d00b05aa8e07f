"""A reply queue at its bound reads as an unreachable client, not as an error that ends the role
answering it (issue 33: every reply queue is bounded, and a client that keeps asking without
reading must not take down the coordinator or the aggregator)."""

from __future__ import annotations

import logging

import pytest

from broker.errors import UnroutableError
from broker.memory_broker import InMemoryBroker, InMemoryHub
from broker.messages import Error, new_message_id
from broker.topology import QueueLimits, reply_queue, reply_queue_name
from services.common.outbox import Outbox

LOG = logging.getLogger("test.outbox")


def test_a_full_reply_queue_is_an_unreachable_client() -> None:
    hub = InMemoryHub()
    broker = InMemoryBroker(hub)
    broker.declare([reply_queue("j", "c1", QueueLimits(reply_max_length=2))])
    outbox = Outbox(broker, "j", LOG)

    def message() -> Error:
        return Error("j", "c1", new_message_id(), 1, "code", "reason")

    sizes = [outbox.reply("c1", message()) for _ in range(2)]
    assert all(size > 0 for size in sizes)
    with pytest.raises(UnroutableError, match="reply queue of client 'c1' is full"):
        outbox.reply("c1", message())
    # The best-effort path says so and goes on.
    assert outbox.error("c1", 1, "code", "reason") is False
    assert broker.queue_depth(reply_queue_name("j", "c1")) == 2
