"""FedDeper (Zhou et al., depersonalised FL): no split, like FedAvg, plus a personalised model
`v_k` that each client keeps across rounds and a depersonalised upload.

Per round a client trains two copies of the whole model on the same minibatches: `u` from the
round's global model `x`, and its own `v` (`ClientContext.memory`, initialised to the first
global model it receives). It uploads `y = u - lam (v - x)` and reports the accuracy of `v` on
its local test set (`metrics["personal_accuracy"]`); the aggregator averages the `y` weighted
by samples. The rule, chosen by `[algorithm.feddeper] rule` (design §8, `"proximal"`):

    v <- v - eta * (g(v) + rho * (v - x))      personal step, pulled towards x
    u <- u - eta * g(u)                        local step, plain SGD
    y  = u - lam * (v - x)                     the depersonalised upload
    x' = sum_k alpha_k y_k                     server, alpha_k = |D_k| / sum |D_i|

`v - x` is how far the client's own optimum pulls away from the global model; subtracting a
share of it from `u` keeps the client-specific drift out of the average. The paper's own
equations (it alternates the two SGD updates) may differ: docs/algorithms.md says how. A rule
is swappable: another one implements `DeperRule` and is added to `RULES` under its name.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, Protocol, Self

import torch
from pydantic import Field
from torch import nn

from models.state import load_partial
from services.algorithms.base import (
    LocalRound,
    Params,
    RoundResult,
    State,
    StrategyBase,
    Traits,
    algorithm,
    block_parameters,
    full_state,
)
from services.algorithms.recipe import LossFn

# `ClientContext.memory` key prefix of the personalised model's tensors.
PERSONAL = "v:"


class FedDeperSection(Params):
    # Proximal pull of the personalised model v towards the round's global model x.
    rho: float = Field(default=0.1, ge=0)
    # Upload y = u - lam*(v - x).
    lam: float = Field(default=0.5, ge=0)
    # The documented, swappable depersonalisation rule (`RULES`).
    rule: Literal["proximal"] = "proximal"


class DeperRule(Protocol):
    """Directions for the two per-step updates and the upload, per tensor."""

    def personal_direction(
        self, grad: torch.Tensor, v: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor: ...

    def local_direction(
        self, grad: torch.Tensor, u: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor: ...

    def upload(self, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ProximalRule:
    """Design §8's reading (module docstring)."""

    rho: float
    lam: float

    def personal_direction(
        self, grad: torch.Tensor, v: torch.Tensor, x: torch.Tensor
    ) -> torch.Tensor:
        """`g(v) + rho * (v - x)`: the gradient of `f_k(v) + rho/2 * ||v - x||^2`."""
        return grad + self.rho * (v - x)

    def local_direction(self, grad: torch.Tensor, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return grad

    def upload(self, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The upload `y = u - lam * (v - x)`."""
        return u - self.lam * (v - x)


RULES: Mapping[str, Callable[[FedDeperSection], DeperRule]] = MappingProxyType(
    {"proximal": lambda s: ProximalRule(rho=s.rho, lam=s.lam)}
)


def make_rule(section: FedDeperSection) -> DeperRule:
    factory = RULES.get(section.rule)
    if factory is None:
        raise ValueError(f"unknown FedDeper rule {section.rule!r}; known: {sorted(RULES)}")
    return factory(section)


def upload_state(
    rule: DeperRule, u: State, v: State, x: State, parameters: Collection[str]
) -> dict[str, torch.Tensor]:
    """The state a client uploads: `rule.upload` on every trainable parameter; buffers
    (BatchNorm's running statistics and counters) are `u`'s, because a difference of running
    variances can go negative and a counter is not a point in parameter space."""
    if set(u) != set(x) or set(v) != set(x):
        raise ValueError("u, v and x must hold the same tensor names")
    out: dict[str, torch.Tensor] = {}
    for name, u_t in u.items():
        if name in parameters:
            out[name] = rule.upload(u_t.detach(), v[name].detach(), x[name].detach())
        else:
            out[name] = u_t.detach().clone()
    return out


def personal_model(memory: State, x: State) -> dict[str, torch.Tensor] | None:
    """`v` from the client's memory, or None when it holds none that fits the model `x`
    (first round, or a job with another model)."""
    v = {name[len(PERSONAL) :]: t for name, t in memory.items() if name.startswith(PERSONAL)}
    if set(v) != set(x) or any(v[n].shape != x[n].shape for n in x):
        return None
    return v


def remember(memory: dict[str, torch.Tensor], v: State) -> None:
    """Replace the personalised model in `memory` (in place: the client owns the dict)."""
    for name in [n for n in memory if n.startswith(PERSONAL)]:
        del memory[name]
    memory.update({PERSONAL + name: t.detach().clone() for name, t in v.items()})


def _backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss: LossFn) -> None:
    model.zero_grad(set_to_none=True)
    loss(model(x), y).backward()


def _grad(p: nn.Parameter) -> torch.Tensor:
    # A parameter the loss does not reach (none in the built-in models) has no gradient.
    return p.grad if p.grad is not None else torch.zeros_like(p)


@algorithm("feddeper", params=FedDeperSection, shards="one")
class FedDeper(StrategyBase):
    rule: DeperRule = field(default_factory=lambda: make_rule(FedDeperSection()))
    name: str = "feddeper"
    # Both rules are SGD steps on rewritten gradients (the paper's alternating SGD): an
    # adaptive optimizer would rescale the pull towards x and the drift correction.
    traits = Traits(personal_on_clients=True, client_optimizers=frozenset({"sgd"}))

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        assert isinstance(params, FedDeperSection)
        return cls(rule=make_rule(params), name=name)

    def client_round(self, r: LocalRound) -> RoundResult:
        model = r.model
        x = full_state(model)
        # `model` becomes u; v is a copy of it holding the client's own weights.
        v_model = copy.deepcopy(model)
        load_partial(v_model, personal_model(r.context.memory, x) or x)
        u_params, v_params = block_parameters(model), block_parameters(v_model)
        u_opt = r.hyper.client_optimizer(u_params.values())
        v_opt = r.hyper.client_optimizer(v_params.values())
        model.train()
        v_model.train()
        samples = 0
        for xb, yb in r.batches:
            # u first: the client's training-loss tally (a forward hook, which the copy v
            # inherits) counts only the first training forward of each batch.
            _backward(model, xb, yb, r.hyper.loss)
            _backward(v_model, xb, yb, r.hyper.loss)
            with torch.no_grad():
                for name, p in u_params.items():
                    p.grad = self.rule.local_direction(_grad(p), p, x[name])
                for name, p in v_params.items():
                    p.grad = self.rule.personal_direction(_grad(p), p, x[name])
            u_opt.step()
            v_opt.step()
            samples += int(yb.shape[0])
        v = full_state(v_model)
        remember(r.context.memory, v)
        upload = upload_state(self.rule, full_state(model), v, x, set(u_params))
        personal = r.context.local_accuracy(v_model)
        metrics = {
            "train_samples": float(samples),
            "personal_accuracy": personal,
            # Per client in the report too (`extra.personal_accuracy.<client>`).
            "report.personal_accuracy": personal,
        }
        return RoundResult(upload, metrics=metrics)
