"""The experiments by name; experiment `<name>` is `services.experiments.<name>.build()`.

Its module, and torch with it, is imported when the experiment is built, not here: the CLI
lists these names as the choices of `splitmq experiment`, and `splitmq --help` or the
`splitmq check` healthcheck must not pay for torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # it imports the results and the report, and torch with them
    from services.experiments.experiment import Experiment

NAMES = ("minibatch_sfl", "feddeper", "subfedavg", "splitgp", "fedsplitx")


def get_experiment(name: str) -> Experiment:
    """The experiment `name`; `KeyError` naming the known ones otherwise."""
    if name not in NAMES:
        raise KeyError(f"unknown experiment {name!r}; known: {', '.join(sorted(NAMES))}")
    experiment: Experiment = import_module(f"services.experiments.{name}").build()
    if experiment.name != name:
        raise KeyError(f"services.experiments.{name} builds {experiment.name!r}")
    return experiment
