"""What every algorithm implements, on the client, the worker and the aggregator.

An algorithm is one module holding a `StrategyBase` subclass, registered by the `algorithm`
decorator with its name(s), its `[algorithm.<name>]` parameter section, whether it stays
synchronous and how many server shards it runs (`services.algorithms.registry` finds it).
The strategy is narrow: the client's round, the aggregation, a few hooks with defaults, its
class-wide `Traits`, and for a split algorithm the workers' half as an object of its own
(`ServerSide`: the server step and what the workers and the coordinator know of it). The math
lives in pure functions (`averaging`, `sfl.weighted_step`), unit-tested without a broker;
`services.testing` holds the contract every strategy must meet.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import ClassVar, Literal, Protocol, Self, TypeVar, dataclass_transform

import torch
from pydantic import BaseModel, ConfigDict
from torch import nn

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from models.state import client_state, head_state, server_state
from services.algorithms.averaging import weighted_average
from services.algorithms.defences import Defences, Smashed
from services.algorithms.recipe import (
    LossFn,
    OptimizerFactory,
    cross_entropy,
    loss_function,
    optimizer_factory,
    paced,
)
from services.algorithms.training import LossSection, OptimizerSection, ScheduleSection

State = Mapping[str, torch.Tensor]
VersionWeights = dict[BlobRef, dict[str, torch.Tensor]]
Batches = Iterable[tuple[torch.Tensor, torch.Tensor]]
# Per batch of a server step, in input order: (dL/dz, loss, correct).
StepResults = list[tuple[torch.Tensor, float, int]]

CLIENT = BlobRef(CLIENT_PART)
SERVER = BlobRef(SERVER_PART)
AUX = BlobRef(AUX_PART)


class Params(BaseModel):
    """Base of an algorithm's `[algorithm.<name>]` section: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class Hyper:
    """Client- and server-side training parameters of one job: `lr`, `momentum` and
    `server_lr` make plain SGD unless the recipe's `[optimizer]` names another one."""

    lr: float
    momentum: float = 0.0
    server_lr: float = 0.0
    local_epochs: int = 1
    max_steps: int = 0  # per round; 0 = whole epochs
    optimizers: OptimizerSection = field(default_factory=OptimizerSection)
    schedules: ScheduleSection = field(default_factory=ScheduleSection)
    losses: LossSection = field(default_factory=LossSection)
    # Where a client's round stands in the schedule: the round (from 0) and its steps.
    round: int = 0
    steps: int = 0

    def at_round(self, round_: int, steps: int) -> Hyper:
        """These parameters for a client's round `round_` of `steps` optimizer steps."""
        return replace(self, round=round_, steps=steps)

    def client_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """A fresh optimizer at the round's point of the schedule (per step: the round's
        first step, counted as `round * steps`)."""
        choice, plan = self.optimizers.client_side, self.schedules.client_side
        make = self._sgd(self.lr) if choice is None else optimizer_factory(choice)
        position = self.round * self.steps if plan and plan.every == "step" else self.round
        return paced(make, params, plan, position)

    def server_optimizer(
        self, params: Iterable[nn.Parameter], *, version: int = 1, steps: int = 0
    ) -> torch.optim.Optimizer:
        """A fresh optimizer for the server side of `version` whose replica took `steps`
        optimizer steps so far (a per-step schedule's position; per round: `version - 1`)."""
        choice, plan = self.optimizers.server_side, self.schedules.server_side
        make = (
            self._sgd(self.server_lr or self.lr)
            if choice is None
            else optimizer_factory(choice, "optimizer.server")
        )
        position = steps if plan and plan.every == "step" else max(0, version - 1)
        return paced(make, params, plan, position, "schedule.server")

    @cached_property
    def loss(self) -> LossFn:
        """`loss(logits, labels)`: the training loss of a batch, on either side (`[loss]`;
        cross-entropy by default), resolved once: a batch calls torch's function directly."""
        return loss_function(self.losses)

    def _sgd(self, lr: float) -> OptimizerFactory:
        momentum = self.momentum
        return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


class Tally(Protocol):
    def metrics(self) -> Mapping[str, float]:
        """The round's training loss/accuracy so far, as the worker reported it ({}: none)."""
        ...


class SmashedChannel(Protocol):
    """The client's line to its shard: what `services.client` provides to an algorithm."""

    @property
    def tally(self) -> Tally:
        """What the worker reported of this round's batches (Sub-FedAvg's accuracy gate)."""
        ...

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        """Send smashed data and block until the gradient dL/dz for it comes back."""
        ...

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        """Send smashed data without waiting (local-loss algorithms)."""
        ...

    def forward(self, z: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        """U-shaped split: send smashed data without labels and block until the output of the
        server's last block for it comes back."""
        ...

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        """U-shaped split: send dL/d(that output) of the last `forward` and block until dL/dz
        comes back."""
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
class LocalRound:
    """One local round as the client hands it to `client_round`."""

    model: SplitNet  # holding the assigned weights; trained in place
    cut: str
    batches: Batches
    steps: int
    channel: SmashedChannel
    hyper: Hyper
    context: ClientContext


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

    @property
    def trained_samples(self) -> float:
        """The rows the client trained this round (its `train_samples`), else its |D_k|."""
        reported = self.metrics.get("train_samples")
        return float(self.samples) if reported is None else float(reported)


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


@dataclass(eq=False)
class OpenStep:
    """A U-shaped server step between its forward and its backward: per batch, the input z_n
    (a leaf requiring grad), the output of the server's last block (its graph kept) and the
    batch's weight in the step."""

    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    weights: list[float]


# How many server shards (S) a job runs: one, one per client, or `[algorithm] shards`.
ShardRule = Literal["one", "per_client", "configured"]


@dataclass(frozen=True)
class AlgorithmSpec:
    """One registered algorithm name: what the config and the roles know before building it."""

    name: str
    strategy: type[StrategyBase]
    params: type[Params] | None = None  # its `[algorithm.<section>]` model; None: no params
    section: str = ""  # the TOML key of `params`; "": the name
    sync_only: bool = False  # `rounds.mode = "async"` is refused at load time
    shard_rule: ShardRule = "configured"

    def shards(self, configured: int, clients: int) -> int:
        """S after the rule (design §1)."""
        if self.shard_rule == "one":
            return 1
        return clients if self.shard_rule == "per_client" else configured

    def build(self, params: Mapping[str, object] | None = None) -> StrategyBase:
        """The strategy with `params` validated by its section, and the defences on smashed
        data its `privacy.` keys set (`ValueError` when bad)."""
        defences, own = Defences.split(params or {})
        section = self.params.model_validate(own) if self.params else None
        strategy = self.strategy.create(self.name, section)
        return replace(strategy, defences=defences) if defences.active else strategy


S = TypeVar("S", bound="type[StrategyBase]")


@dataclass_transform(frozen_default=True, kw_only_default=True, field_specifiers=(field,))
def algorithm(
    name: str,
    *,
    params: type[Params] | None = None,
    section: str = "",
    sync_only: bool = False,
    shards: ShardRule = "configured",
) -> Callable[[S], S]:
    """Register the decorated strategy class under `name` (stack it for several names).

    The class becomes a frozen keyword-only dataclass, as every strategy is (no `@dataclass`
    needed; one written below `@algorithm` is kept, one above it fails). Registering only
    records the spec on the class: the registry reads it when it imports the module, so
    importing an algorithm has no effect beyond defining it. A subclass of a registered class
    is not registered under its parent's names: it registers names of its own."""

    def register(cls: S) -> S:
        as_strategy(cls)
        spec = AlgorithmSpec(name, cls, params, section or name, sync_only, shards)
        cls._registrations = (*vars(cls).get("_registrations", ()), spec)
        return cls

    return register


def as_strategy(cls: type) -> None:
    """Make `cls` a frozen keyword-only dataclass if it is not one itself; `TypeError` for a
    class that is no strategy, or one between it and `StrategyBase` declaring fields without
    being a dataclass (they would silently be class attributes)."""
    if not issubclass(cls, StrategyBase):
        raise TypeError(f"@algorithm registers StrategyBase subclasses, not {cls.__qualname__}")
    if "__dataclass_params__" not in vars(cls):
        dataclass(frozen=True, kw_only=True)(cls)
    for klass in cls.__mro__[1 : cls.__mro__.index(StrategyBase)]:
        declared = vars(klass).get("__annotations__", {})
        fields = [n for n, a in declared.items() if not str(a).startswith(_CLASS_VARS)]
        if fields and "__dataclass_params__" not in vars(klass):
            raise TypeError(
                f"{klass.__qualname__} declares fields {fields} but is no dataclass: decorate "
                "it with @dataclass(frozen=True, kw_only=True), as every strategy is"
            )


_CLASS_VARS = ("ClassVar", "typing.ClassVar")


@dataclass(frozen=True)
class Traits:
    """What the roles consult of an algorithm before building it, the same for every instance
    of its class (`StrategyBase.traits`)."""

    # The personalised models live only on the clients (FedDeper's v_k): the run's personalised
    # accuracy is the mean of their `metrics["personal_accuracy"]`, not the aggregator's
    # evaluation of published blobs.
    personal_on_clients: bool = False
    # It trains auxiliary heads at the cuts (SplitGP, FedSplitX): the job's model has them
    # (`services.common.jobmodel`), version 1 holds them as `aux/global`; others get none.
    uses_heads: bool = False
    # The run's algorithm.png: panel title -> fnmatch patterns of the version records' `extra`
    # series (fractions, drawn in %) the algorithm reports of its own (none: no figure).
    report_plots: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # The client optimizers (lower-case torch.optim names) its update rule is written for;
    # None: any. The config refuses another at load time (docs/training.md).
    client_optimizers: frozenset[str] | None = None


@dataclass(frozen=True)
class ServerSide:
    """The workers' half of a split algorithm (`StrategyBase.server`): the step they take on
    smashed data, and what the workers, the coordinator and the config know of it. A subclass
    overrides `step`, and `forward` for a U-shaped split."""

    # The client blocks on a GradientReply after each SmashedBatch (False: local losses).
    waits_for_gradient: bool = True
    # One server step per step index over the whole cohort (MiniBatch-SFL): needs rounds.
    barrier: bool = False
    # It trains a U-shaped split (`model.tail`): the client's round uses the channel's
    # forward/backward, the worker's step is `forward` then `ushape.backward_open`.
    u_shaped: bool = False
    # Workers answer InferRequests (SplitGP's split inference, `workers.inference`).
    split_inference: bool = False
    # The depth level of a client that declares no capability (FedSplitX's levels).
    default_level: int = 1
    # A client uploads only part of `client/global` (FedSplitX: up to its level).
    partial_client_updates: bool = False

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        """One server step with the job's `loss`; per batch (dL/dz, loss, correct) in input
        order (an empty dL/dz where the client waits for none)."""
        raise NotImplementedError(f"{type(self).__qualname__}.step")

    def forward(
        self, server: nn.Module, zs: Sequence[torch.Tensor], weights: Sequence[float]
    ) -> OpenStep:
        """A U-shaped step's forward over a step's batches (`weights`: the worker's p_n, or
        the rows); the default refuses, for a server side without a U-shaped split."""
        raise RuntimeError(f"{type(self).__qualname__} has no U-shaped split: unset model.tail")

    def batch_cuts(self, model: SplitNet, cut: str) -> tuple[str, ...]:
        """The cuts smashed data may come from, shallow to deep (FedSplitX: its levels). The
        worker's replica starts at the first; the coordinator assigns clients among them."""
        return (cut,)

    def cut_label(self, cut: str) -> str:
        """Where the model is split, as the run's banner says it (`cut`: the job's)."""
        return cut


@dataclass(frozen=True, kw_only=True)
class StrategyBase:
    """One algorithm: the client's round, the aggregation and, for a split algorithm, the
    workers' half as its own object. Every hook has its default; override what differs.

    Its members, all of them (`tests/unit/test_strategy_shape.py` holds it to at most 12):
    `name`, `defences` and `traits` (data); `server` (the workers' half, None: no split);
    `create`, `for_model`, `initial_weights`, `client_round`, `smashed`, `aggregate`,
    `personal_metrics` and `async_refusal` (hooks). The registrations `algorithm` records
    stay private to the registry.
    """

    name: str = ""
    # What the client does to its smashed data before sending it (off by default).
    defences: Defences = field(default_factory=Defences)
    traits: ClassVar[Traits] = Traits()
    # The specs `algorithm` recorded on this very class (not inherited: see the registry).
    _registrations: ClassVar[tuple[AlgorithmSpec, ...]] = ()

    @cached_property
    def server(self) -> ServerSide | None:
        """The workers' half; None (the default) for an algorithm that does not split: the
        whole model trains on the client and no smashed data travels."""
        return None

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        """The strategy registered as `name`, from its validated parameter section."""
        return cls(name=name)

    def for_model(self, model: Callable[[], SplitNet], cut: str) -> Self:
        """The strategy as the aggregator runs it, bound to what aggregation needs of the
        model (FedSplitX: which blocks follow which cut); `model` is called only then."""
        return self

    def async_refusal(self) -> str | None:
        """Why this strategy cannot run in `rounds.mode = "async"`; None when it can."""
        if self.server is not None and self.server.barrier:
            return (
                f"{self.name} takes one server step per step index over the whole cohort: "
                "that barrier needs a cohort, i.e. rounds"
            )
        return None

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        """Blobs of version 1, from a freshly seeded model: client, server and heads for a
        split algorithm, else the whole model as `client/global`."""
        if self.server is None:
            return {CLIENT: full_state(model)}
        out = {CLIENT: client_state(model, cut), SERVER: server_state(model, cut)}
        if model.heads:
            out[AUX] = head_state(model, model.cuts)
        return out

    def client_round(self, r: LocalRound) -> RoundResult:
        """Train the client side for one round; `r.model` holds the assigned weights."""
        raise NotImplementedError

    def smashed(self, r: LocalRound, x: torch.Tensor, z: torch.Tensor, step: int) -> Smashed:
        """Step `step`'s smashed data z of inputs x as the client sends it: the defences
        applied (noise seeded by the job, the client, the round and the step), in z's graph.
        Every split algorithm's client step goes through here when a defence is on (SFL's
        sends z itself when none is: `defences.active`, read once a round)."""
        d, c = self.defences, r.context
        stream = d.generator(z.device, c.client, c.round, step) if d.noise_scale else None
        return d.apply(x, z, stream)

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        """The next version's blobs from a round's updates and replicas; FedAvg-style by
        default (`average_round`)."""
        return average_round(previous, updates, replicas)

    def personal_metrics(
        self,
        model: SplitNet,
        blobs: VersionWeights,
        x: torch.Tensor,
        y: torch.Tensor,
        clients: Mapping[str, Sequence[int]],
    ) -> dict[str, float]:
        """Metrics of each client's model in a published version for the report's `extra`
        (SplitGP: head, server and split-inference accuracy), on the test rows (x, y);
        `clients` maps each id to its classes, `model` is a scratch model."""
        return {}


def assign_level(capability: int, levels: int, default: int) -> int:
    """The depth level of a client declaring `capability` (the deepest level it can run):
    itself, capped at the `levels` there are; `default` (also capped) when it declares none."""
    if levels < 1:
        raise ValueError(f"need at least one level, got {levels}")
    wanted = capability if capability > 0 else default
    return max(1, min(wanted, levels))


# The name the roles annotate with.
Strategy = StrategyBase


def full_state(model: SplitNet) -> dict[str, torch.Tensor]:
    """The blocks' state (heads excluded): the whole model of a non-split algorithm."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("blocks.")}


def block_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The blocks' parameters (heads excluded): what a non-split algorithm trains."""
    return {n: p for n, p in model.named_parameters() if n.startswith("blocks.")}


def full_model_weights(blobs: VersionWeights, client: str | None = None) -> dict[str, torch.Tensor]:
    """The whole model of a version: heads, server side, client side, and with `client` that
    client's personal blobs on top. FedAvg's client blob already is the whole model."""
    merged: dict[str, torch.Tensor] = {}
    for part in (AUX_PART, SERVER_PART, CLIENT_PART):
        merged.update(blobs.get(BlobRef(part), {}))
        if client is not None:
            merged.update(blobs.get(BlobRef(part, client), {}))
    return merged


def average_replicas(out: VersionWeights, replicas: Sequence[ShardReplica]) -> VersionWeights:
    """`out` with `server/global` the replicas averaged by the samples they trained on (kept
    as it is when none trained)."""
    trained = [r for r in replicas if r.samples > 0]
    if trained:
        out[SERVER] = weighted_average([r.weights for r in trained], [r.samples for r in trained])
    return out


def average_round(
    previous: VersionWeights, updates: Sequence[ClientUpdate], replicas: Sequence[ShardReplica]
) -> VersionWeights:
    """`previous` with `client/global` the FedAvg of the uploads, alpha_k = |D_k| / sum |D_i|,
    and `server/global` that of the shard replicas by samples trained."""
    if not updates:
        raise ValueError("no client updates to aggregate")
    out = dict(previous)
    out[CLIENT] = weighted_average(
        [u.client_weights for u in updates], [u.samples for u in updates]
    )
    return average_replicas(out, replicas)
