"""Algorithm name (+ its parameters) → strategy.

Each factory takes the algorithm's `params` (the values of its `[algorithm.<name>]` section,
as `AlgorithmSection.params()` gives them and the coordinator forwards them to clients) and
validates them itself, so a client built from a Welcome's config is held to the same rules as
the service's own settings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from broker.messages import ConfigValue
from services.algorithms.base import Strategy
from services.algorithms.fedavg import FedAvg
from services.algorithms.feddeper import FedDeper
from services.algorithms.fedsplitx import FedSplitX
from services.algorithms.minibatch_sfl import MiniBatchSFL
from services.algorithms.sfl import SFL
from services.algorithms.splitgp import SplitGP
from services.algorithms.standalone import Standalone
from services.algorithms.subfedavg import SubFedAvg

Params = Mapping[str, ConfigValue]
StrategyFactory = Callable[[Params], Strategy]

STRATEGIES: Mapping[str, StrategyFactory] = MappingProxyType(
    {
        "fedavg": lambda _p: FedAvg(),
        "sfl_v1": lambda _p: SFL(name="sfl_v1"),
        "sfl_v2": lambda _p: SFL(name="sfl_v2"),
        "sfl": lambda _p: SFL(),
        "minibatch_sfl": lambda _p: MiniBatchSFL(),
        "fedsplitx": lambda p: FedSplitX.from_params(p),
        "local_loss_sfl": lambda p: FedSplitX.local_loss_sfl(p),
        "splitgp": SplitGP.from_params,
        "subfedavg": SubFedAvg.from_params,
        "standalone": lambda _p: Standalone(),
        "feddeper": lambda p: FedDeper.from_params(p),
    }
)


def build_strategy(name: str, params: Params | None = None) -> Strategy:
    """The strategy `name` with `params`; `ValueError` for an unknown name or bad parameters."""
    factory = STRATEGIES.get(name)
    if factory is None:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(STRATEGIES)}")
    return factory(params or {})
