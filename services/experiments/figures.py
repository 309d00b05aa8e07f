"""PNG figures of an experiment: one row of panels, each filled by a drawing function.

The declared plots (metric vs round, a run summary against a tag) and the experiments' own
figures (`Experiment.extras`) go through `FigureSlot.figure`, drawn on
`services.report.plots.panel_figure`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.experiments.results import ResultSet, SeedRuns
from services.experiments.spec import CurvePlot, FinalPlot, Plot
from services.report.plots import PanelDraw, line_style, panel_figure, plot_rounds, round_axis


def plot_band(axes: Any, i: int, run: SeedRuns, metric: str, label: str, size: int = 2) -> None:
    """The i-th line: `metric` per round as a percentage, the mean over the seeds with a band
    of ± one standard deviation in the line's colour (no band for one seed)."""
    band = run.band(metric)
    plot_rounds(axes, i, run.records, [100.0 * b.mean for b in band], label, size)
    if len(run.runs) > 1:
        xs = [r.round for r in run.records]
        low = [100.0 * (b.mean - b.std) for b in band]
        high = [100.0 * (b.mean + b.std) for b in band]
        axes.fill_between(xs, low, high, alpha=0.2, color=axes.lines[-1].get_color())


def _curve(plot: CurvePlot, results: ResultSet, axes: Any, where: dict[str, str]) -> bool:
    drawn = False
    for i, line in enumerate(results.values(plot.lines)):
        run = results.one({**where, plot.lines: line})
        if run is not None and run.records:
            plot_band(axes, i, run, plot.metric, line, 3)
            drawn = True
    round_axis(axes)
    axes.set_ylabel(f"{plot.metric.replace('_', ' ')} (%)")
    return drawn


def _final(plot: FinalPlot, results: ResultSet, axes: Any, where: dict[str, str]) -> bool:
    xs = results.values(plot.x)
    drawn = False
    for i, line in enumerate(results.values(plot.lines)):
        spreads = [
            results.spread(plot.metric, **where, **{plot.lines: line, plot.x: x}) for x in xs
        ]
        ys = [100.0 * s.mean for s in spreads]
        if any(math.isfinite(y) for y in ys):
            # Error bars: the std over the seeds (none drawn for one seed).
            errors = [100.0 * s.std if s.count > 1 else 0.0 for s in spreads]
            axes.errorbar(range(len(xs)), ys, yerr=errors, label=line, capsize=3, **line_style(i))
            drawn = True
    axes.set_xticks(range(len(xs)), xs)
    axes.set_xlabel(plot.x)
    axes.set_ylabel(f"{plot.metric.replace('_', ' ')} accuracy (%)")
    return drawn


def write_figure(plot: Plot, results: ResultSet, slot: FigureSlot) -> str:
    """Draw `plot` into the slot's `plot.file`: its link, "" when no run has data for it."""
    if not any(all(r.tags.get(k) == v for k, v in plot.where.items()) for r in results):
        return ""  # only tag-less baselines fit: nothing of this plot's own was run
    tag = plot.panels
    panels = results.values(tag) if tag else [""]

    def draw(axes: Any, value: str) -> bool:
        where = {**plot.where, **({tag: value} if tag else {})}
        if isinstance(plot, CurvePlot):
            return _curve(plot, results, axes, where)
        return _final(plot, results, axes, where)

    titles = [f"{tag} = {value}" if tag else "" for value in panels]
    return slot.figure(plot.file, plot.title, panels, draw, "", titles)


@dataclass(frozen=True)
class FigureSlot:
    """Where an experiment's own figures (`Experiment.extras`) go, and how the section links
    them: files `<directory>/<prefix><name>`, links relative to the results file's folder."""

    directory: Path
    prefix: str
    base: Path

    def figure(
        self,
        name: str,
        title: str,
        panels: Sequence[str],
        draw: PanelDraw,
        ylabel: str = "accuracy (%)",
        titles: Sequence[str] = (),
    ) -> str:
        """`panel_figure` drawn into `<directory>/<prefix><name>`: its link, "" when nothing was
        drawn."""
        made = panel_figure(
            self.directory / (self.prefix + name), title, panels, draw, ylabel=ylabel, titles=titles
        )
        if made is None:
            return ""
        return f"![{made.stem}]({os.path.relpath(made, self.base).replace(os.sep, '/')})"
