"""Experiment name → the function that builds it (built on demand: building reads its config).

Experiment `<name>` lives in `services.experiments.<name>` (whose NAME is `<name>`). Its module,
and torch with it, is imported when the experiment is built, not here: the CLI lists these
names as the choices of `splitmq experiment`, and `splitmq --help` or the `splitmq check`
healthcheck must not pay for torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from types import MappingProxyType

from services.experiments.spec import Experiment

_NAMES = ("minibatch_sfl", "feddeper", "subfedavg", "splitgp", "fedsplitx")


def _builder(name: str) -> Callable[[], Experiment]:
    def build() -> Experiment:
        module = import_module(f"services.experiments.{name}")
        if module.NAME != name:
            raise KeyError(f"services.experiments.{name} registers as {module.NAME!r}")
        experiment: Experiment = module.build()
        return experiment

    return build


EXPERIMENTS: Mapping[str, Callable[[], Experiment]] = MappingProxyType(
    {name: _builder(name) for name in _NAMES}
)


def get_experiment(name: str) -> Experiment:
    """The experiment `name`; `KeyError` naming the known ones otherwise."""
    factory = EXPERIMENTS.get(name)
    if factory is None:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(sorted(EXPERIMENTS))}")
    return factory()
