"""An experiment: a named, reproducible comparison of runs, its tables and plots, the paper's
claim and what to say of the numbers; `from_examples` reads its config and words from
`examples/experiments/`."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from services.experiments.figures import FigureSlot
from services.experiments.results import ResultSet
from services.experiments.spec import EXAMPLES_DIR, FinalEval, Plot, Run, Table

Verdict = Callable[[ResultSet], list[str]]
# Markdown blocks placed after the tables (own tables, links to figures drawn into the slot).
Extras = Callable[[ResultSet, FigureSlot], Sequence[str]]


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
