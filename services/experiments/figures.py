"""PNG figures of an experiment: one row of panels, each filled by a drawing function.

The declared plots (metric vs round, a run summary against a tag) and the experiments' own
figures (`Experiment.extras`) go through `FigureSlot.figure`. matplotlib's object API on an explicit
Agg canvas, imported on first use, as in `services.report.plots`: no pyplot state and no GUI
backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.experiments.results import ResultSet
from services.experiments.spec import CurvePlot, FinalPlot, Plot
from services.report.records import VersionRecord

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")

# Fills one panel (`axes`, the panel's value); True when it drew labelled lines.
PanelDraw = Callable[[Any, str], bool]


def line_style(i: int) -> dict[str, Any]:
    """Marker and dash of the i-th line: equal lines stay visible."""
    return {"marker": _MARKERS[i % len(_MARKERS)], "linestyle": _LINES[i % len(_LINES)]}


def plot_rounds(
    axes: Any,
    i: int,
    records: Sequence[VersionRecord],
    ys: Sequence[float],
    label: str,
    size: int = 2,
) -> None:
    """The i-th line of `ys` (one per record, in percent) against the round, from 1."""
    axes.plot([r.round + 1 for r in records], ys, label=label, markersize=size, **line_style(i))
    round_axis(axes)


def round_axis(axes: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    axes.set_xlabel("round")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))


def panel_figure(
    path: Path,
    title: str,
    panels: Sequence[str],
    draw: PanelDraw,
    *,
    ylabel: str = "",
    titles: Sequence[str] = (),
) -> Path | None:
    """One row of panels, each filled by `draw(axes, panel)` and titled by `titles` (default:
    the panels); None, and no file, when nothing was drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        return None
    figure = Figure(figsize=(4.2 * len(panels) + 0.6, 3.8), dpi=100)
    FigureCanvasAgg(figure)
    axes_row = figure.subplots(1, len(panels), squeeze=False)[0]
    drawn = False
    for axes, panel, name in zip(axes_row, panels, titles or panels, strict=True):
        if draw(axes, panel):
            drawn = True
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize="small")
        if name:
            axes.set_title(name)
        if ylabel:
            axes.set_ylabel(ylabel)
    if not drawn:
        return None
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _curve(plot: CurvePlot, results: ResultSet, axes: Any, where: dict[str, str]) -> bool:
    drawn = False
    for i, line in enumerate(results.values(plot.lines)):
        run = results.one({**where, plot.lines: line})
        if run is not None and run.records:
            plot_rounds(axes, i, run.records, [100.0 * v for v in run.curve(plot.metric)], line, 3)
            drawn = True
    round_axis(axes)
    axes.set_ylabel(f"{plot.metric.replace('_', ' ')} (%)")
    return drawn


def _final(plot: FinalPlot, results: ResultSet, axes: Any, where: dict[str, str]) -> bool:
    xs = results.values(plot.x)
    drawn = False
    for i, line in enumerate(results.values(plot.lines)):
        found = [results.one({**where, plot.lines: line, plot.x: x}) for x in xs]
        ys = [100.0 * r.metric(plot.metric) if r else math.nan for r in found]
        if any(math.isfinite(y) for y in ys):
            axes.plot(range(len(xs)), ys, label=line, **line_style(i))
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
