"""FedDeper (Zhou et al., depersonalised FL): no split, like FedAvg, plus a personalised model
`v_k` that each client keeps across rounds and a depersonalised upload.

Per round a client trains two copies of the whole model on the same minibatches: `u` from the
round's global model `x`, and its own `v` (`ClientContext.memory`, initialised to the first
global model it receives). It uploads `y = u - lam (v - x)` and reports the accuracy of `v` on
its local test set (`metrics["personal_accuracy"]`); the aggregator averages the `y` weighted
by samples. The step and upload rule is `services.algorithms.feddeper_rules`, chosen by
`[algorithm.feddeper] rule`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from broker.messages import ConfigValue
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.averaging import weighted_average
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    RoundResult,
    ShardReplica,
    SmashedChannel,
    VersionWeights,
)
from services.algorithms.fedavg import CLIENT, full_state
from services.algorithms.feddeper_rules import DeperRule, make_rule, upload_state
from services.config.algorithms import FedDeperSection

# `ClientContext.memory` key prefix of the personalised model's tensors.
PERSONAL = "v:"


def personal_model(
    memory: Mapping[str, torch.Tensor], x: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """`v` from the client's memory, or None when it holds none that fits the model `x`
    (first round, or a job with another model)."""
    v = {name[len(PERSONAL) :]: t for name, t in memory.items() if name.startswith(PERSONAL)}
    if set(v) != set(x) or any(v[n].shape != x[n].shape for n in x):
        return None
    return v


def remember(memory: dict[str, torch.Tensor], v: Mapping[str, torch.Tensor]) -> None:
    """Replace the personalised model in `memory` (in place: the client owns the dict)."""
    for name in [n for n in memory if n.startswith(PERSONAL)]:
        del memory[name]
    memory.update({PERSONAL + name: t.detach().clone() for name, t in v.items()})


def block_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if n.startswith("blocks.")}


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


@dataclass(frozen=True)
class FedDeper:
    rule: DeperRule = field(default_factory=lambda: make_rule(FedDeperSection()))
    name: str = "feddeper"
    splits: bool = False
    waits_for_gradient: bool = False
    server_barrier: bool = False
    # The personalised models live only on the clients: the run's personalised accuracy is what
    # they report, not the aggregator's evaluation (`services.algorithms.base.personal_on_clients`).
    personal_on_clients: bool = True

    @classmethod
    def from_params(cls, params: Mapping[str, ConfigValue]) -> FedDeper:
        return cls(rule=make_rule(FedDeperSection.model_validate(dict(params))))

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        return {CLIENT: full_state(model)}

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
        x = full_state(model)
        # `model` becomes u; v is a copy of it holding the client's own weights.
        v_model = copy.deepcopy(model)
        load_partial(v_model, personal_model(context.memory, x) or x)
        u_params, v_params = block_parameters(model), block_parameters(v_model)
        u_opt = hyper.client_optimizer(u_params.values())
        v_opt = hyper.client_optimizer(v_params.values())
        model.train()
        v_model.train()
        samples = 0
        for xb, yb in batches:
            # u first: the client's training-loss tally (a forward hook, which the copy v
            # inherits) counts only the first training forward of each batch.
            _backward(model, xb, yb)
            _backward(v_model, xb, yb)
            with torch.no_grad():
                for name, p in u_params.items():
                    p.grad = self.rule.local_direction(_grad(p), p, x[name])
                for name, p in v_params.items():
                    p.grad = self.rule.personal_direction(_grad(p), p, x[name])
            u_opt.step()
            v_opt.step()
            samples += int(yb.shape[0])
        v = full_state(v_model)
        remember(context.memory, v)
        upload = upload_state(self.rule, full_state(model), v, x, set(u_params))
        personal = context.local_accuracy(v_model)
        metrics = {
            "train_samples": float(samples),
            "personal_accuracy": personal,
            # Per client in the report too (`extra.personal_accuracy.<client>`).
            "report.personal_accuracy": personal,
        }
        return RoundResult(upload, metrics=metrics)

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
        raise RuntimeError("FedDeper has no server-side model: no smashed data should arrive")

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        """`x <- sum_k alpha_k y_k`, alpha_k by samples."""
        if not updates:
            raise ValueError("no client updates to aggregate")
        out = dict(previous)
        out[CLIENT] = weighted_average(
            [u.client_weights for u in updates], [u.samples for u in updates]
        )
        return out


def _grad(p: nn.Parameter) -> torch.Tensor:
    # A parameter the loss does not reach (none in the built-in models) has no gradient.
    return p.grad if p.grad is not None else torch.zeros_like(p)
