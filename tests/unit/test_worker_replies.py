"""`workers.replies.Replier`: gradients go out transient, back-pressure is waited out."""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

from broker.codec import decode
from broker.errors import BackPressureError, UnroutableError
from broker.messages import GradientReply, new_message_id
from broker.topology import REPLIES_EXCHANGE, reply_routing_key
from workers.replies import Replier


class SpyBroker:
    """Records publishes; refuses the first `refuse` of them, or routes nothing."""

    def __init__(self, refuse: int = 0, unroutable: bool = False) -> None:
        self.calls: list[tuple[str, str, bytes, dict[str, Any]]] = []
        self._refuse = refuse
        self._unroutable = unroutable

    def publish(self, exchange: str, routing_key: str, body: bytes, **kwargs: Any) -> None:
        self.calls.append((exchange, routing_key, body, kwargs))
        if self._unroutable:
            raise UnroutableError("no queue")
        if len(self.calls) <= self._refuse:
            raise BackPressureError("full")


def reply(seq: int = 7) -> GradientReply:
    return GradientReply(
        job="j",
        client="c1",
        message_id=new_message_id(),
        version=3,
        seq=seq,
        status="ok",
        loss=0.5,
        correct=2,
        samples=4,
        grad=torch.ones(4, 3, dtype=torch.float16),
    )


def replier(broker: SpyBroker, sleeps: list[float]) -> Replier:
    return Replier(
        broker,  # type: ignore[arg-type]  # only publish is used
        threading.Event(),
        logging.getLogger("test"),
        sleep=sleeps.append,
    )


def test_a_gradient_goes_to_its_client_transient_and_intact() -> None:
    broker, sleeps = SpyBroker(), list[float]()
    message = reply()
    assert replier(broker, sleeps).send(message)
    [(exchange, key, body, kwargs)] = broker.calls
    assert (exchange, key) == (REPLIES_EXCHANGE, reply_routing_key("j", "c1"))
    assert kwargs == {"message_id": message.message_id, "persistent": False}
    decoded = decode(body)
    assert isinstance(decoded, GradientReply) and decoded.seq == 7
    assert decoded.grad is not None and decoded.grad.dtype == torch.float16
    assert sleeps == []


def test_back_pressure_is_retried_with_growing_delays() -> None:
    broker, sleeps = SpyBroker(refuse=3), list[float]()
    assert replier(broker, sleeps).send(reply())
    assert len(broker.calls) == 4
    assert sleeps == [0.05, 0.1, 0.2]


def test_a_vanished_client_is_not_fatal() -> None:
    broker, sleeps = SpyBroker(unroutable=True), list[float]()
    assert not replier(broker, sleeps).send(reply())
    assert len(broker.calls) == 1
