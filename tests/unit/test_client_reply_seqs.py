"""The client's reply queue, in the style of `test_bad_input`: a GradientReply for a seq the
client never sent is dead-lettered with its reason before anything looks at it; one for an
earlier seq (a late copy of an answer taken already) is a duplicate, passed on to be dropped;
an ok answer to the awaited seq without a gradient of its batch's shape ends the round."""

from __future__ import annotations

import pytest
import torch

from broker.codec import encode
from broker.memory_broker import InMemoryBroker
from broker.messages import GradientReply, SmashedBatch, new_message_id
from broker.topology import REPLIES_EXCHANGE, dead_queue, reply_routing_key
from broker.transport import PublishOptions
from services.client.errors import RoundAborted
from services.client.stats import ClientStats
from services.common.backends import Embedded
from tests.unit.test_bad_input import client_link, dead_letters

NEXT_SEQ = 1_000


def reply(job: str, seq: int) -> bytes:
    grad = torch.randn(2, 3)
    return encode(GradientReply(job, "c0", new_message_id(), 1, seq, "ok", 0.1, 1, 2, grad))


def test_replies_for_seqs_never_sent_are_dead_lettered(job: str) -> None:
    embedded = Embedded()
    broker = InMemoryBroker(embedded.hub)
    broker.declare([dead_queue(job)])
    stats = ClientStats()
    link = client_link(InMemoryBroker(embedded.hub), job, stats, seq_start=NEXT_SEQ)
    key = reply_routing_key(job, "c0")
    never_sent = {"next seq": NEXT_SEQ, "past next seq": NEXT_SEQ + 1, "far ahead": 2**62}
    for message_id, seq in never_sent.items():
        broker.publish(
            REPLIES_EXCHANGE, key, reply(job, seq), PublishOptions(message_id=message_id)
        )
    broker.publish(
        REPLIES_EXCHANGE, key, reply(job, NEXT_SEQ - 1), PublishOptions(message_id="late copy")
    )

    message = link.poll(10.0)

    assert isinstance(message, GradientReply) and message.seq == NEXT_SEQ - 1
    found = dead_letters(broker, job)
    assert sorted(found) == sorted(never_sent)
    for message_id, seq in never_sent.items():
        (reason,) = found[message_id]
        assert f"seq {seq}, never sent by this client (its next seq is {NEXT_SEQ})" in reason
    assert stats.dead_lettered == len(never_sent)
    # Taking a seq moves the bound: the reply to it is valid once it was sent.
    link.next_seq += 1  # as sending the batch of seq NEXT_SEQ does
    broker.publish(REPLIES_EXCHANGE, key, reply(job, NEXT_SEQ), PublishOptions(message_id="answer"))
    answer = link.poll(10.0)
    assert isinstance(answer, GradientReply) and answer.seq == NEXT_SEQ


def test_a_bad_gradient_for_the_awaited_seq_ends_the_round_only_when_it_is_ours(job: str) -> None:
    embedded = Embedded()
    broker = InMemoryBroker(embedded.hub)
    broker.declare([dead_queue(job)])
    stats = ClientStats()
    link = client_link(InMemoryBroker(embedded.hub), job, stats, seq_start=NEXT_SEQ + 1)
    z = torch.randn(2, 3)
    awaited = SmashedBatch(job, "c0", "b", 1, NEXT_SEQ, 0, 0, 0, z, torch.zeros(2).long())
    wrong_shape = torch.randn(2, 4)
    key = reply_routing_key(job, "c0")
    # Another client's answer to the same seq is dead-lettered, the round goes on.
    theirs = GradientReply(job, "c1", new_message_id(), 1, NEXT_SEQ, "ok", 0.1, 1, 2, wrong_shape)
    broker.publish(REPLIES_EXCHANGE, key, encode(theirs), PublishOptions(message_id="theirs"))
    assert link.poll(1.0, awaiting=awaited) is None
    ours = GradientReply(job, "c0", new_message_id(), 1, NEXT_SEQ, "ok", 0.1, 1, 2, wrong_shape)
    broker.publish(REPLIES_EXCHANGE, key, encode(ours), PublishOptions(message_id="ours"))
    with pytest.raises(RoundAborted, match=r"gradient shape \[2, 4\], expected \[2, 3\]"):
        link.poll(10.0, awaiting=awaited)
    found = dead_letters(broker, job)
    assert "for client 'c1'" in found["theirs"][0] and "gradient shape" in found["ours"][0]
