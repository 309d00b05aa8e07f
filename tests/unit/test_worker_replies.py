"""`workers.replies.Replier`: gradients go out transient, back-pressure is waited out."""

from __future__ import annotations

import logging
import threading

import torch

from broker.codec import decode
from broker.errors import BackPressureError, UnroutableError
from broker.messages import GradientReply, new_message_id
from broker.topology import REPLIES_EXCHANGE, reply_routing_key
from broker.transport import PLAIN, PublishOptions, Refused
from workers.replies import Replier


class SpyBroker:
    """Records publishes; refuses the first `refuse` of them, or routes nothing."""

    def __init__(self, refuse: int = 0, unroutable: bool = False) -> None:
        self.calls: list[tuple[str, str, bytes, PublishOptions]] = []
        self._refuse = refuse
        self._unroutable = unroutable
        self.pending: list[Refused] = []  # what `refused` hands back next

    def publish(
        self, exchange: str, routing_key: str, body: bytes, options: PublishOptions = PLAIN
    ) -> None:
        self.calls.append((exchange, routing_key, body, options))
        if self._unroutable:
            raise UnroutableError("no queue")
        if len(self.calls) <= self._refuse:
            raise BackPressureError("full")

    def refused(self) -> list[Refused]:
        taken, self.pending = self.pending, []
        return taken


def reply(seq: int = 7, client: str = "c1") -> GradientReply:
    return GradientReply(
        job="j",
        client=client,
        message_id=new_message_id(),
        version=3,
        seq=seq,
        status="ok",
        loss=0.5,
        correct=2,
        samples=4,
        grad=torch.ones(4, 3, dtype=torch.float16),
    )


def replier(broker: SpyBroker, sleeps: list[float], keep: int = 1024) -> Replier:
    return Replier(
        broker,  # type: ignore[arg-type]  # only publish is used
        threading.Event(),
        logging.getLogger("test"),
        sleep=sleeps.append,
        keep=keep,
    )


def test_a_gradient_goes_to_its_client_transient_and_intact() -> None:
    broker, sleeps = SpyBroker(), list[float]()
    message = reply()
    assert replier(broker, sleeps).send(message)
    [(exchange, key, body, options)] = broker.calls
    assert (exchange, key) == (REPLIES_EXCHANGE, reply_routing_key("j", "c1"))
    assert options == PublishOptions(message.message_id, persistent=False, confirm_later=True)
    decoded = decode(body)
    assert isinstance(decoded, GradientReply) and decoded.seq == 7
    assert decoded.grad is not None and decoded.grad.dtype == torch.float16
    assert sleeps == []


def test_back_pressure_is_retried_with_growing_delays() -> None:
    broker, sleeps = SpyBroker(refuse=3), list[float]()
    assert replier(broker, sleeps).send(reply())
    assert len(broker.calls) == 4
    assert sleeps == [0.05, 0.1, 0.2]


def test_a_reply_queue_that_stays_full_does_not_stall_the_shard() -> None:
    # A client that stopped reading its replies: its queue at the bound (issue 33). The worker
    # gives the reply up after a few short tries instead of waiting for that one client.
    broker, sleeps = SpyBroker(refuse=1_000), list[float]()
    assert not replier(broker, sleeps).send(reply())
    assert len(broker.calls) == 4
    assert sum(sleeps) < 0.5


def test_a_vanished_client_is_not_fatal() -> None:
    broker, sleeps = SpyBroker(unroutable=True), list[float]()
    assert not replier(broker, sleeps).send(reply())
    assert len(broker.calls) == 1


def test_the_last_reply_of_a_client_is_sent_again_for_its_seq() -> None:
    broker, sleeps = SpyBroker(), list[float]()
    replies = replier(broker, sleeps)
    first = reply(seq=7)
    assert replies.send(first)
    assert replies.resend("j", "c1", 7) is True
    (_, key, body, options) = broker.calls[-1]
    again = decode(body)
    assert isinstance(again, GradientReply) and key == reply_routing_key("j", "c1")
    assert again.message_id == options.message_id != first.message_id
    assert (again.seq, again.status, again.loss, again.samples) == (7, "ok", 0.5, 4)
    assert first.grad is not None and again.grad is not None
    assert torch.equal(again.grad, first.grad)
    # Another seq, another client or another job: nothing kept to answer with.
    assert replies.resend("j", "c1", 6) is None
    assert replies.resend("j", "c2", 7) is None
    assert replies.resend("k", "c1", 7) is None
    assert len(broker.calls) == 2


def test_only_gradients_are_kept_one_per_client_and_clients_are_bounded() -> None:
    broker, sleeps = SpyBroker(), list[float]()
    replies = replier(broker, sleeps, keep=2)
    assert replies.send(reply(seq=1, client="a"))
    refused = GradientReply(
        job="j", client="a", message_id=new_message_id(), version=3, seq=2, status="rejected",
        loss=0.0, correct=0, samples=0, grad=None, reason="too_stale: old",
    )  # fmt: skip
    assert replies.send(refused)
    assert replies.resend("j", "a", 2) is None  # a refusal is not an answer to keep
    assert replies.resend("j", "a", 1) is True
    assert replies.send(reply(seq=5, client="a"))  # a later seq replaces the earlier one
    assert replies.resend("j", "a", 1) is None
    assert replies.send(reply(seq=1, client="b"))
    assert replies.send(reply(seq=1, client="c"))  # a third client: the least recent goes
    assert replies.resend("j", "a", 5) is None
    assert replies.resend("j", "b", 1) is True and replies.resend("j", "c", 1) is True


def test_a_resend_to_a_vanished_client_is_not_fatal() -> None:
    broker, sleeps = SpyBroker(unroutable=True), list[float]()
    replies = replier(broker, sleeps)
    assert not replies.send(reply())
    assert replies.resend("j", "c1", 7) is False


def test_replies_are_not_waited_for_and_refusals_are_dealt_with_at_the_next_send() -> None:
    broker = SpyBroker()
    replies = replier(broker, [])
    later = PublishOptions("m", persistent=False, confirm_later=True)
    full = Refused(REPLIES_EXCHANGE, "j.c1", b"full", later, BackPressureError("full"))
    gone = Refused(REPLIES_EXCHANGE, "j.c2", b"gone", later, UnroutableError("no queue"))
    broker.pending = [full, gone]
    assert replies.send(reply(seq=8))
    # The full queue's reply again, confirmed this time; the gone client's only logged.
    (_, key, body, options), (_, last_key, _, last) = broker.calls
    assert (key, body, options.confirm_later) == ("j.c1", b"full", False)
    assert last_key == reply_routing_key("j", "c1") and last.confirm_later
