"""A joining client's depth level and cut (FedSplitX), from the capability it declares.

Jobs whose algorithm has one cut give every client the job's cut. FedSplitX's levels are its
partition points, shallow to deep; a client declaring capability c (the deepest level it can
run) gets level min(c, M), one declaring nothing gets the level its data partition has in
`clients.capability_mix`, else `[algorithm.fedsplitx] default_level`. So simulated clients get
the same level whether they asked for a partition (`splitmq run`/`up`) or were given one
(compose's scaled clients), and a re-joining member keeps its record.
"""

from __future__ import annotations

from services.algorithms.base import batch_cuts
from services.algorithms.fedsplitx_math import assign_level
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model
from services.config.root import Settings


class LevelDesk:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._cuts: tuple[str, ...] | None = None

    def cuts(self) -> tuple[str, ...]:
        """The job's level cuts, shallow to deep (the model is built once, if needed)."""
        if self._cuts is None:
            settings = self._settings
            strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
            if callable(getattr(strategy, "batch_cuts", None)):
                self._cuts = batch_cuts(strategy, job_model(settings), settings.model.cut)
            else:
                self._cuts = (settings.model.cut,)
        return self._cuts

    def level(self, capability: int, partition: int) -> int:
        """The 1-based level of a client declaring `capability` with data `partition`."""
        settings = self._settings
        declared = capability or settings.clients.declared_capability(partition)
        return assign_level(declared, len(self.cuts()), settings.algorithm.fedsplitx.default_level)

    def cut(self, capability: int, partition: int) -> str:
        return self.cuts()[self.level(capability, partition) - 1]
