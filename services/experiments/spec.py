"""What an experiment declares: its runs, the tables and plots of its results, the paper's claim.

Runs carry *tags* (``algorithm``, ``r``, ``cut``...). Tables and plots select runs by tags; a
run without a tag matches every value of it, so a baseline that does not depend on the cut
(FedAvg, centralized) is one run that shows up in every cut's row and plot.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from services.algorithms.base import VersionWeights
    from services.config.root import Settings
    from services.data.loaders import Dataset
    from services.experiments.figures import FigureSlot
    from services.experiments.results import ResultSet

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
Verdict = Callable[["ResultSet"], list[str]]
# Metrics of a finished service run's last version, computed in the experiment's process from
# the weights the embedded store still holds (e.g. every client's model, which the aggregator
# evaluates for the round's cohort only); the run directory's `final.json`, `RunResult.final`.
FinalEval = Callable[["Settings", "Dataset", "VersionWeights"], Mapping[str, float]]
# Markdown blocks placed after the tables (own tables, links to figures drawn into the slot).
Extras = Callable[["ResultSet", "FigureSlot"], Sequence[str]]


@dataclass(frozen=True)
class Experiment:
    """A named, reproducible comparison; how to add one: CONTRIBUTING.md."""

    name: str
    title: str
    summary: str  # what is compared and how (markdown)
    claim: str  # the paper's claim, quoted beside our numbers
    scaling: str  # how the paper's setup was shrunk to fit the time budget
    base: Mapping[str, Any]  # the config every run starts from (TOML shape)
    runs: Sequence[Run]
    quick_runs: Sequence[Run]  # the smoke-size grid of --quick
    quick: Mapping[str, Any]  # overrides applied to every run under --quick
    tables: Sequence[Table] = ()
    plots: Sequence[Plot] = ()
    verdict: Verdict | None = None  # plain sentences from the numbers: agreement or not
    notes: str = ""  # fixed remarks on how our setup differs from the paper's
    final_eval: FinalEval | None = None  # service runs only; see `FinalEval`
    extras: Extras | None = None  # see `Extras`
    stall_s: float = 0.0  # see CONTRIBUTING.md; 0: wait for ever
    # `--paper`: the paper's own setting (`<name>-paper.toml`), the grid to run on it (the
    # usual grid when None) and its words (`<name>-paper.md`, the usual ones when absent).
    paper_base: Mapping[str, Any] | None = None
    paper_runs: Sequence[Run] | None = None
    paper_words: Mapping[str, str] = field(default_factory=dict)

    def grid(self, quick: bool) -> Sequence[Run]:
        return self.quick_runs if quick else self.runs

    def at_paper(self) -> Experiment:
        """This experiment at the paper's setting: its own section `<name>-paper` of the
        results and its own run directories, so the scaled results stay beside it."""
        if self.paper_base is None:
            where = EXAMPLES_DIR / f"{self.name}-paper.toml"
            raise FileNotFoundError(f"experiment {self.name} has no paper setting ({where})")
        words = self.paper_words
        return replace(
            self,
            name=f"{self.name}-paper",
            title=self.paper_words.get("title", f"{self.title} (paper setting)"),
            base=self.paper_base,
            runs=self.paper_runs if self.paper_runs is not None else self.runs,
            paper_base=None,
            paper_runs=None,
            paper_words={},
            summary=words.get("summary", self.summary),
            claim=words.get("claim", self.claim),
            scaling=words.get("scaling", self.scaling),
            notes=words.get("notes", self.notes),
        )


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


# The sections of `examples/experiments/<name>.md` and the `Experiment` fields they fill.
_WORDS = {"Summary": "summary", "Paper's claim": "claim", "Scaling": "scaling", "Notes": "notes"}


def _words(path: Path) -> dict[str, str]:
    """The title and the `_WORDS` sections of an experiment's markdown file."""
    title, _, rest = path.read_text(encoding="utf-8").partition("\n")
    words = {"title": title.removeprefix("# ").strip(), "notes": ""}
    for block in rest.split("\n## ")[1:]:
        heading, _, text = block.partition("\n")
        words[_WORDS[heading.strip()]] = text.strip()
    return words


def _toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"experiment config {path} not found: experiments run from a SplitMQ source tree"
        ) from None


def from_examples(name: str, **fields: Any) -> Experiment:
    """Experiment `name` with its base config and words from `examples/experiments/<name>.toml`
    and `.md` (CONTRIBUTING.md, "Adding an experiment"), its paper setting from
    `<name>-paper.toml` and `.md` where they exist, the rest from `fields`."""
    base = _toml(EXAMPLES_DIR / f"{name}.toml")
    words = _words(EXAMPLES_DIR / f"{name}.md")
    paper = EXAMPLES_DIR / f"{name}-paper.toml"
    paper_md = EXAMPLES_DIR / f"{name}-paper.md"
    return Experiment(
        name=name,
        title=words.pop("title"),
        summary=words["summary"],
        claim=words["claim"],
        scaling=words["scaling"],
        notes=words["notes"],
        base=base,
        paper_base=_toml(paper) if paper.exists() else None,
        paper_words=_words(paper_md) if paper_md.exists() else {},
        **fields,
    )
