"""Algorithm name → strategy."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from services.algorithms.base import Strategy
from services.algorithms.fedavg import FedAvg
from services.algorithms.minibatch_sfl import MiniBatchSFL
from services.algorithms.sfl import SFL

STRATEGIES: Mapping[str, Callable[[], Strategy]] = MappingProxyType(
    {
        "fedavg": FedAvg,
        "sfl_v1": lambda: SFL(name="sfl_v1"),
        "sfl_v2": lambda: SFL(name="sfl_v2"),
        "sfl": SFL,
        "minibatch_sfl": MiniBatchSFL,
    }
)


def build_strategy(name: str) -> Strategy:
    factory = STRATEGIES.get(name)
    if factory is None:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(STRATEGIES)}")
    return factory()
