"""PNG figures of an experiment: metric vs round, and a run summary against a tag.

matplotlib's object API on an explicit Agg canvas, imported on first use, as in
`services.report.plots`: no pyplot state and no GUI backend.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.experiments.results import ResultSet, RunResult
from services.experiments.spec import CurvePlot, FinalPlot, Plot

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")

Draw = Callable[[Any, dict[str, str]], bool]


def _style(i: int) -> dict[str, Any]:
    return {"marker": _MARKERS[i % len(_MARKERS)], "linestyle": _LINES[i % len(_LINES)]}


def _panels(plot: Plot, results: ResultSet) -> list[str]:
    return results.values(plot.panels) if plot.panels else [""]


def _figure(path: Path, title: str, panels: Sequence[str], tag: str, draw: Draw) -> Path | None:
    """One row of panels (one per value of `tag`), each filled by `draw(axes, where)`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(4.2 * len(panels) + 0.6, 3.8), dpi=100)
    FigureCanvasAgg(figure)
    axes_list = figure.subplots(1, len(panels), squeeze=False)[0]
    drawn = False
    for axes, value in zip(axes_list, panels, strict=True):
        where = {tag: value} if tag else {}
        if draw(axes, where):
            drawn = True
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize="small")
        if tag:
            axes.set_title(f"{tag} = {value}")
    if not drawn:
        return None
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def _curve(plot: CurvePlot, results: ResultSet) -> Draw:
    def draw(axes: Any, panel: dict[str, str]) -> bool:
        from matplotlib.ticker import MaxNLocator

        drawn = False
        for i, line in enumerate(results.values(plot.lines)):
            run = results.one({**plot.where, **panel, plot.lines: line})
            if run is None or not run.records:
                continue
            xs = [r.round + 1 for r in run.records]
            ys = [100.0 * float(getattr(r, plot.metric)) for r in run.records]
            axes.plot(xs, ys, label=line, markersize=3, **_style(i))
            drawn = True
        axes.set_xlabel("round")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylabel(f"{plot.metric.replace('_', ' ')} (%)")
        return drawn

    return draw


def _final(plot: FinalPlot, results: ResultSet) -> Draw:
    def draw(axes: Any, panel: dict[str, str]) -> bool:
        xs = results.values(plot.x)
        drawn = False
        for i, line in enumerate(results.values(plot.lines)):
            found: list[RunResult | None] = [
                results.one({**plot.where, **panel, plot.lines: line, plot.x: x}) for x in xs
            ]
            ys = [100.0 * r.metric(plot.metric) if r else math.nan for r in found]
            if not any(math.isfinite(y) for y in ys):
                continue
            axes.plot(range(len(xs)), ys, label=line, **_style(i))
            drawn = True
        axes.set_xticks(range(len(xs)), xs)
        axes.set_xlabel(plot.x)
        axes.set_ylabel(f"{plot.metric.replace('_', ' ')} accuracy (%)")
        return drawn

    return draw


def write_figure(plot: Plot, results: ResultSet, directory: Path) -> Path | None:
    """Draw `plot` into `directory/plot.file`; None when no run has data for it."""
    named = [r for r in results if all(r.tags.get(k) == v for k, v in plot.where.items())]
    if not named:
        return None  # only tag-less baselines fit: nothing of this plot's own was run
    draw = _curve(plot, results) if isinstance(plot, CurvePlot) else _final(plot, results)
    return _figure(directory / plot.file, plot.title, _panels(plot, results), plot.panels, draw)


@dataclass(frozen=True)
class FigureSlot:
    """Where an experiment's own figures (`Experiment.extras`) go, and how the section links
    them: files `<directory>/<prefix><name>`, links relative to the results file's folder."""

    directory: Path
    prefix: str
    base: Path

    def path(self, name: str) -> Path:
        return self.directory / (self.prefix + name)

    def link(self, path: Path) -> str:
        return f"![{path.stem}]({os.path.relpath(path, self.base).replace(os.sep, '/')})"


PanelDraw = Callable[[Any, str], bool]


def panel_figure(
    path: Path, title: str, panels: Sequence[str], draw: PanelDraw, *, ylabel: str = ""
) -> Path | None:
    """One row of panels titled by `panels`, each filled by `draw(axes, panel)` (True when it
    drew something, with labelled lines); None, and no file, when nothing was drawn."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not panels:
        return None
    figure = Figure(figsize=(4.2 * len(panels) + 0.6, 3.8), dpi=100)
    FigureCanvasAgg(figure)
    drawn = False
    for axes, panel in zip(figure.subplots(1, len(panels), squeeze=False)[0], panels, strict=True):
        if draw(axes, panel):
            drawn = True
            axes.grid(True, alpha=0.3)
            axes.legend(fontsize="small")
        axes.set_title(panel)
        if ylabel:
            axes.set_ylabel(ylabel)
    if not drawn:
        return None
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png")
    return path


def line_style(i: int) -> dict[str, Any]:
    """Marker and dash of the i-th line, as the harness's own plots draw them."""
    return _style(i)
