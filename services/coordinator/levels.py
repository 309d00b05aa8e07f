"""A joining client's depth level and cut (FedSplitX), from the capability it declares: the rule
is docs/algorithms.md, "FedSplitX and local-loss SFL", **Levels**. Jobs whose algorithm has
one cut give every client the job's cut.

"""

from __future__ import annotations

from functools import cached_property

from services.algorithms.base import StrategyBase, assign_level
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model
from services.config.root import Settings


class LevelDesk:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    @cached_property
    def _strategy(self) -> StrategyBase:
        algorithm = self._settings.algorithm
        return build_strategy(algorithm.name, algorithm.params())

    @cached_property
    def _cuts(self) -> tuple[str, ...]:
        settings = self._settings
        return self._strategy.batch_cuts(job_model(settings), settings.model.cut)

    def cuts(self) -> tuple[str, ...]:
        """The job's level cuts, shallow to deep (the model is built once)."""
        return self._cuts

    def cut(self, capability: int, partition: int) -> str:
        """The cut of the 1-based level of a client declaring `capability` with `partition`."""
        declared = capability or self._settings.clients.declared_capability(partition)
        level = assign_level(declared, len(self._cuts), self._strategy.default_level)
        return self._cuts[level - 1]
