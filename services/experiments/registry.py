"""Experiment name → the function that builds it (built on demand: building reads its config)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from services.experiments import feddeper, fedsplitx, minibatch_sfl, splitgp, subfedavg
from services.experiments.spec import Experiment

EXPERIMENTS: Mapping[str, Callable[[], Experiment]] = MappingProxyType(
    {
        minibatch_sfl.NAME: minibatch_sfl.build,
        feddeper.NAME: feddeper.build,
        subfedavg.NAME: subfedavg.build,
        splitgp.NAME: splitgp.build,
        fedsplitx.NAME: fedsplitx.build,
    }
)


def get_experiment(name: str) -> Experiment:
    """The experiment `name`; `KeyError` naming the known ones otherwise."""
    factory = EXPERIMENTS.get(name)
    if factory is None:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(sorted(EXPERIMENTS))}")
    return factory()
