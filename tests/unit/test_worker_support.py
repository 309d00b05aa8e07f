"""Shared pieces of the worker tests: settings, a seeded version 1, a scripted client.

No tests here; the worker test modules import it as `tests.unit.test_worker_support`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from broker.codec import decode, encode
from broker.messages import (
    GradientReply,
    Message,
    RoundEnd,
    RoundStart,
    SmashedBatch,
    new_message_id,
)
from broker.store import WeightStore
from broker.topology import (
    SMASHED_EXCHANGE,
    QueueLimits,
    job_queues,
    reply_queue,
    reply_queue_name,
    shard_routing_key,
)
from broker.transport import Broker, Delivery
from models.parts import ServerModel
from models.split import SplitNet
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model
from services.config.root import Settings

CUT = "block1"
ROWS = 8


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tiny models on a shared 2-core machine: intra-op threads only add contention (a step
    took 100x longer with two). Restored afterwards, as torch's setting is process-wide."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_settings(job: str, /, **sections: Mapping[str, Any]) -> Settings:
    """Job settings for tests; `sections` override whole sections' fields."""
    raw: dict[str, Any] = {
        "job": {"name": job, "seed": 0},
        "model": {"name": "cnn5", "cut": CUT},
        "algorithm": {"name": "sfl_v2", "lr": 0.05},
        "clients": {"count": 3},
        "workers": {"checkpoint_every_steps": 3, "lease_ttl_s": 0.6, "device": "cpu"},
    }
    if "optimizer" in sections:  # the [algorithm] SGD settings would clash with it
        del raw["algorithm"]["lr"]
    for name, fields in sections.items():
        raw[name] = {**raw.get(name, {}), **fields}
    return Settings.model_validate(raw)


def seed_version(store: WeightStore, settings: Settings) -> SplitNet:
    """Publish version 1 from a seeded model, as the aggregator does at start-up."""
    torch.manual_seed(settings.job.seed)
    model = job_model(settings)
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    store.publish_version(settings.job.name, 0, strategy.initial_weights(model, CUT))
    return model


def reference_server(model: SplitNet, settings: Settings) -> tuple[ServerModel, torch.optim.SGD]:
    """A private copy of version 1's server side and the optimizer a worker would use."""
    server = ServerModel(copy.deepcopy(model), CUT)
    server.train()
    lr = settings.algorithm.server_lr or settings.algorithm.lr
    return server, torch.optim.SGD(server.parameters(), lr=lr, momentum=settings.algorithm.momentum)


def random_batch(
    model: SplitNet, gen: torch.Generator, rows: int = ROWS
) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.randn((rows, *model.cut_shape(CUT)), generator=gen)
    y = torch.randint(0, model.num_classes, (rows,), generator=gen)
    return z, y


@dataclass
class ScriptedClient:
    """Publishes what clients and the aggregator would put on a shard queue; reads replies."""

    broker: Broker
    job: str
    shards: int = 1

    def declare(self, clients: Sequence[str], limits: QueueLimits | None = None) -> None:
        specs = job_queues(self.job, self.shards, limits or QueueLimits())
        specs += [reply_queue(self.job, c) for c in clients]
        self.broker.declare(specs)

    def publish(self, shard: int, message: Message | bytes) -> None:
        body = message if isinstance(message, bytes) else encode(message)
        self.broker.publish(SMASHED_EXCHANGE, shard_routing_key(self.job, shard), body)

    def round_start(
        self, round_: int, participants: Mapping[str, int], *, shard: int = 0, version: int = 1
    ) -> None:
        self.publish(
            shard,
            RoundStart(self.job, "", new_message_id(), version, round_, shard, dict(participants)),
        )

    def round_end(self, round_: int, *, shard: int = 0, version: int = 1) -> None:
        self.publish(shard, RoundEnd(self.job, "", new_message_id(), version, round_, shard))

    def batch(
        self,
        client: str,
        seq: int,
        z: torch.Tensor,
        y: torch.Tensor,
        *,
        shard: int = 0,
        round_: int = 0,
        step: int = 0,
        steps: int = 0,
        version: int = 1,
        job: str | None = None,
        to: int | None = None,
    ) -> SmashedBatch:
        """Publish a SmashedBatch to shard `to` (default: the shard it names)."""
        message = SmashedBatch(
            job=job or self.job,
            client=client,
            message_id=new_message_id(),
            version=version,
            seq=seq,
            shard=shard,
            round=round_,
            step=step,
            activations=z,
            labels=y,
            steps=steps,
        )
        self.publish(shard if to is None else to, message)
        return message

    def replies(self, client: str) -> list[GradientReply]:
        """Every reply already waiting in the client's queue (after a burst worker returned)."""
        waiting = self.broker.queue_depth(reply_queue_name(self.job, client))
        return self.drain_replies(client, waiting)

    def drain_replies(
        self, client: str, expected: int, *, timeout: float = 20.0
    ) -> list[GradientReply]:
        """Exactly the replies up to `expected` (waiting for each at most `timeout`)."""
        queue = reply_queue_name(self.job, client)
        self.broker.subscribe(queue, prefetch=100)
        out: list[GradientReply] = []
        try:
            while len(out) < expected:
                delivery = self.broker.get(timeout)
                if delivery is None:
                    break
                out.append(self._reply(delivery))
        finally:
            self.broker.unsubscribe(queue)
        return out

    def _reply(self, delivery: Delivery) -> GradientReply:
        self.broker.ack(delivery)
        reply = decode(delivery.body)
        assert isinstance(reply, GradientReply)
        return reply
