"""The interfaces every algorithm implements, on the client, the worker and the aggregator.

An algorithm is one small module that builds a `Strategy`: a few traits the roles consult
(does the client wait for a gradient? does the worker step once per cohort step?), the
client's round, the worker's step, and the aggregation. The math lives in pure functions
(`averaging`, `server_math`) so it is unit-tested without a broker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from broker.store import BlobRef
from models.split import SplitNet

State = Mapping[str, torch.Tensor]
VersionWeights = dict[BlobRef, dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Hyper:
    """Client- and server-side training parameters of one job."""

    lr: float
    momentum: float = 0.0
    server_lr: float = 0.0
    local_epochs: int = 1
    max_steps: int = 0  # per round; 0 = whole epochs

    def client_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)

    def server_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.server_lr or self.lr, momentum=self.momentum)


class SmashedChannel(Protocol):
    """The client's line to its shard: what `services.client` provides to an algorithm."""

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        """Send smashed data and block until the gradient dL/dz for it comes back."""
        ...

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        """Send smashed data without waiting (local-loss algorithms)."""
        ...


@dataclass
class ClientContext:
    """What a client's round may use beyond its model, data, channel and hyper-parameters."""

    client: str
    round: int
    # Tensors an algorithm keeps on this client from round to round (FedDeper's v_k,
    # Sub-FedAvg's mask). They live in the client process: a restarted client starts afresh.
    memory: dict[str, torch.Tensor] = field(default_factory=dict)
    # Accuracy of a model (inputs -> logits) on this client's local test set (the test samples
    # of its own classes); 0.0 when it has none.
    local_accuracy: Callable[[nn.Module], float] = lambda _m: 0.0


@dataclass(frozen=True)
class RoundResult:
    """What a client uploads after its local round."""

    client_weights: dict[str, torch.Tensor]
    aux_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    masks: dict[str, torch.Tensor] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ClientUpdate:
    """One client's WeightsUpdate, as the aggregator hands it to `aggregate`."""

    client: str
    samples: int
    base_version: int
    client_weights: State
    aux_weights: State = field(default_factory=dict)
    masks: State = field(default_factory=dict)
    metrics: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class ShardReplica:
    """A shard's server-side state at the end of a round, and how many samples it trained on."""

    shard: int
    samples: int
    weights: State


@dataclass(frozen=True)
class CohortBatch:
    """One client's smashed batch as the worker hands it to `server_step`."""

    client: str
    activations: torch.Tensor
    labels: torch.Tensor
    weight: float = 1.0  # p_n of MiniBatch-SFL; rows for folded SFL


class Strategy(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def splits(self) -> bool:
        """False for FedAvg: the whole model trains on the client, no smashed data."""
        ...

    @property
    def waits_for_gradient(self) -> bool:
        """The client blocks on a GradientReply after each SmashedBatch."""
        ...

    @property
    def server_barrier(self) -> bool:
        """MiniBatch-SFL: the worker takes one step per step index over the whole cohort."""
        ...

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        """Blobs of version 1, from a freshly seeded model."""
        ...

    def client_round(
        self,
        model: SplitNet,
        cut: str,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int,
        channel: SmashedChannel,
        hyper: Hyper,
        context: ClientContext,
    ) -> RoundResult:
        """Train the client side for one round; `model` holds the assigned weights."""
        ...

    def server_step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
    ) -> list[tuple[torch.Tensor, float, int]]:
        """One server step; per batch (dL/dz, loss, correct) in input order."""
        ...

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        """Turn a round's updates and shard replicas into the blobs of the next version."""
        ...
