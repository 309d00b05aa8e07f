"""What an experiment's grid declares: its runs, the tables and plots of its results (the
experiment itself: `services.experiments.experiment`).

Runs carry *tags* (``algorithm``, ``r``, ``cut``...). Tables and plots select runs by tags; a
run without a tag matches every value of it, so a baseline that does not depend on the cut
(FedAvg, centralized) is one run that shows up in every cut's row and plot.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from services.algorithms.base import VersionWeights
    from services.config.root import Settings
    from services.data.loaders import Dataset

# Experiments are reproduced from a clone: their base configs sit beside the other examples.
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples" / "experiments"

RunKind = Literal["service", "centralized"]
# Per-run summaries a table can show (see `results.RunResult.metric`).
Metric = Literal["final_global", "best_global", "final_personal", "best_personal"]


@dataclass(frozen=True)
class Run:
    """One job of an experiment (fields: CONTRIBUTING.md, "Adding an experiment")."""

    label: str
    tags: Mapping[str, str]
    overrides: Mapping[str, Any] = field(default_factory=dict)
    kind: RunKind = "service"


@dataclass(frozen=True)
class Table:
    """A markdown table: one row per combination of the `rows` tags, one column per value of
    the `column` tag, each cell the run's `metric` in percent; `diffs` add columns `a − b`
    (percentage points) between two column values."""

    title: str
    rows: tuple[str, ...]
    column: str
    metric: Metric = "final_global"
    diffs: tuple[tuple[str, str], ...] = ()
    columns: tuple[str, ...] = ()  # column order; default: the order runs were declared


@dataclass(frozen=True)
class CurvePlot:
    """Metric vs round: one line per value of `lines`, one panel per value of `panels`,
    among the runs matching `where`. `metric` is a `VersionRecord` field (accuracy in %)."""

    file: str  # PNG name, written under the results' figure folder
    title: str
    lines: str
    panels: str = ""
    where: Mapping[str, str] = field(default_factory=dict)
    metric: str = "global_accuracy"


@dataclass(frozen=True)
class FinalPlot:
    """A run summary (`metric`) against the values of tag `x`: one line per value of `lines`,
    one panel per value of `panels`."""

    file: str
    title: str
    x: str
    lines: str
    panels: str = ""
    where: Mapping[str, str] = field(default_factory=dict)
    metric: Metric = "final_global"


Plot = CurvePlot | FinalPlot
# Metrics of a finished service run's last version, computed in the experiment's process from
# the weights the embedded store still holds (e.g. every client's model, which the aggregator
# evaluates for the round's cohort only); the run directory's `final.json`, `RunResult.final`.
FinalEval = Callable[["Settings", "Dataset", "VersionWeights"], Mapping[str, float]]


def smoke(steps: int = 3, eval_samples: int = 500, **sections: Any) -> dict[str, Any]:
    """The overrides of `--quick`: 2 rounds of at most `steps` local steps, `eval_samples` test
    images, and any other `sections` (e.g. `clients={"count": 6}`)."""
    return {
        "job": {"rounds": 2},
        "algorithm": {"max_steps_per_round": steps},
        "data": {"eval_samples": eval_samples},
        **sections,
    }


def algorithm(name: str, **params: Any) -> dict[str, Any]:
    """Overrides that run algorithm `name` with `params` in its own section."""
    return {"algorithm": {"name": name, **({name: params} if params else {})}}
