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
    # Rows trained per cut the batches came from (FedSplitX: a batch from a shallow client
    # trains more of the replica than one from a deep client). Empty: all from the job's cut.
    cut_samples: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class CohortBatch:
    """One client's smashed batch as the worker hands it to `server_step`."""

    client: str
    activations: torch.Tensor
    labels: torch.Tensor
    weight: float = 1.0  # p_n of MiniBatch-SFL; rows for folded SFL
    cut: str = ""  # the cut the activations come from ("": the replica's own cut)


def personal_on_clients(strategy: object) -> bool:
    """Whether the strategy's personalised models live only on its clients (FedDeper's v_k),
    so that the run's personalised accuracy is the mean of what the clients report in
    `metrics["personal_accuracy"]` rather than the aggregator's evaluation of the published
    blobs. A strategy opts in with a true `personal_on_clients` attribute; `Strategy` does not
    require one."""
    return getattr(strategy, "personal_on_clients", False) is True


def batch_cuts(strategy: object, model: SplitNet, cut: str) -> tuple[str, ...]:
    """The cuts smashed data of the job may come from, shallow to deep: the strategy's
    `batch_cuts(model, cut)` where it has one (FedSplitX's depth levels), else the job's `cut`.
    The worker's replica starts at the first; the coordinator assigns clients among them."""
    own = getattr(strategy, "batch_cuts", None)
    return tuple(own(model, cut)) if callable(own) else (cut,)


def partial_client_updates(strategy: object) -> bool:
    """Whether a client uploads only part of `client/global` (FedSplitX: the blocks up to its
    own depth level); opted into with a true `partial_client_updates` attribute."""
    return getattr(strategy, "partial_client_updates", False) is True


def for_model(strategy: Strategy, model: Callable[[], SplitNet], cut: str) -> Strategy:
    """The strategy as the aggregator runs it: `strategy.for_model(model, cut)` where the
    aggregation needs the model's structure (FedSplitX: which blocks follow which cut), else
    the strategy itself. `model` is called only then."""
    own = getattr(strategy, "for_model", None)
    if not callable(own):
        return strategy
    bound: Strategy = own(model(), cut)
    return bound


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


def personal_metrics(
    strategy: object,
    model: SplitNet,
    blobs: VersionWeights,
    x: torch.Tensor,
    y: torch.Tensor,
    clients: Mapping[str, Sequence[int]],
) -> dict[str, float]:
    """A strategy's metrics of each client's model in a published version (SplitGP: head,
    server and split-inference accuracy on the client's local test set and the others), from
    its `personal_metrics(model, blobs, x, y, clients)` where it has one: the test rows (x, y)
    and `clients` (id -> its classes); `model` is a scratch model. For the report's `extra`."""
    own = getattr(strategy, "personal_metrics", None)
    if not callable(own):
        return {}
    return {str(k): float(v) for k, v in own(model, blobs, x, y, clients).items()}


def serves_inference(strategy: object) -> bool:
    """Whether workers answer InferRequests for this strategy (SplitGP's split inference):
    an optional true `split_inference` attribute."""
    return getattr(strategy, "split_inference", False) is True
