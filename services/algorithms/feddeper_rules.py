"""FedDeper's depersonalisation rule (Zhou et al.), as pure tensor functions.

Each client keeps a personalised model `v` across rounds and trains a local model `u` from the
round's global model `x`, both on the same minibatches. The rule says which direction each
takes per step and what the client uploads. Ours (design §8, `rule = "proximal"`):

    v <- v - eta * (g(v) + rho * (v - x))      personal step, pulled towards x
    u <- u - eta * g(u)                        local step, plain SGD
    y  = u - lam * (v - x)                     the depersonalised upload
    x' = sum_k alpha_k y_k                     server, alpha_k = |D_k| / sum |D_i|

`v - x` is how far the client's own optimum pulls away from the global model; subtracting a
share of it from `u` keeps the client-specific drift out of the average. The paper's own
equations (it alternates the two SGD updates) may differ: docs/algorithms.md says how.

A rule is swappable: another one implements `DeperRule` and is added to `RULES` under the
name that `[algorithm.feddeper] rule` selects.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

import torch

from services.config.algorithms import FedDeperSection

State = Mapping[str, torch.Tensor]


def proximal_direction(
    grad: torch.Tensor, v: torch.Tensor, x: torch.Tensor, rho: float
) -> torch.Tensor:
    """`g(v) + rho * (v - x)`: the gradient of `f_k(v) + rho/2 * ||v - x||^2`."""
    return grad + rho * (v - x)


def sgd_step(p: torch.Tensor, direction: torch.Tensor, lr: float) -> torch.Tensor:
    """`p - lr * direction` (what SGD without momentum does with `direction` as the gradient)."""
    return p - lr * direction


def personal_step(
    v: torch.Tensor, grad: torch.Tensor, x: torch.Tensor, *, lr: float, rho: float
) -> torch.Tensor:
    """One step of the personalised model: `v - lr * (g(v) + rho * (v - x))`."""
    return sgd_step(v, proximal_direction(grad, v, x, rho), lr)


def local_step(u: torch.Tensor, grad: torch.Tensor, *, lr: float) -> torch.Tensor:
    """One step of the local model: `u - lr * g(u)`."""
    return sgd_step(u, grad, lr)


def depersonalised(u: torch.Tensor, v: torch.Tensor, x: torch.Tensor, lam: float) -> torch.Tensor:
    """The upload `y = u - lam * (v - x)`."""
    return u - lam * (v - x)


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
        return proximal_direction(grad, v, x, self.rho)

    def local_direction(self, grad: torch.Tensor, u: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return grad

    def upload(self, u: torch.Tensor, v: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return depersonalised(u, v, x, self.lam)


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
