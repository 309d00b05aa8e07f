"""What a client's Welcome settled (`Membership`), as its assignments change it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from broker.messages import ConfigValue
from services.algorithms.base import Strategy
from services.algorithms.registry import build_strategy
from services.client.plan import RoundPlan, config_int


@dataclass(frozen=True)
class Membership:
    """What the Welcome settled: where this client trains and with what."""

    shard: int
    cut: str
    partition: int
    plan: RoundPlan
    strategy: Strategy

    @classmethod
    def settled(cls, shard: int, cut: str, partition: int, plan: RoundPlan) -> Membership:
        """A Welcome's membership, with the algorithm its `plan` names."""
        return cls(shard, cut, partition, plan, build_strategy(plan.algorithm, plan.params))

    def updated(self, config: Mapping[str, ConfigValue]) -> Membership:
        """This membership as an assignment's `config` changes it (shard, plan, algorithm)."""
        plan = self.plan.updated(config)
        shard = config_int(config, "shard")
        same = (plan.algorithm, plan.params) == (self.plan.algorithm, self.plan.params)
        return replace(
            self,
            shard=self.shard if shard is None else shard,
            plan=plan,
            strategy=self.strategy if same else build_strategy(plan.algorithm, plan.params),
        )
