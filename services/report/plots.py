"""Plots of a run (accuracy, throughput, loss and staleness per round; accuracy against
wall-clock, samples and bytes; an algorithm's own series) and `panel_figure`, the row of
panels that they and the experiments' figures are drawn on, as PNG and, on request, PDF/SVG.

Figures are built on matplotlib's object API with an explicit Agg canvas: no pyplot, so no
global figure registry, no GUI backend and no rcParams change in whoever imports this.
matplotlib is imported on first use: only the process that writes the report pays for it
(every `splitmq` role process imports this module through the CLI).
"""

from __future__ import annotations

import fnmatch
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.report.records import VersionRecord
from services.report.summary import staleness_histogram

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")

STALENESS_PNG = "staleness.png"


@dataclass(frozen=True)
class PlotSpec:
    """Which run plots to write: the file formats, and the algorithm's own panels (title ->
    patterns of `extra` series; `Traits.report_plots`)."""

    formats: Sequence[str] = ("png",)
    algorithm: Mapping[str, Sequence[str]] = field(default_factory=dict)


# Fills one panel (`axes`, the panel's value); True when it drew labelled lines.
PanelDraw = Callable[[Any, str], bool]


def line_style(i: int) -> dict[str, Any]:
    """Marker and dash of the i-th line: equal lines (global = personal for SFL) stay visible."""
    return {"marker": _MARKERS[i % len(_MARKERS)], "linestyle": _LINES[i % len(_LINES)]}


def plot_rounds(
    axes: Any,
    i: int,
    records: Sequence[VersionRecord],
    ys: Sequence[float],
    label: str,
    size: int = 2,
) -> None:
    """The i-th line of `ys` (one per record) against the round, counted from 1 as in the
    summary."""
    axes.plot([r.round for r in records], ys, label=label, markersize=size, **line_style(i))
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
    formats: Sequence[str] = ("png",),
) -> Path | None:
    """One row of panels, each filled by `draw(axes, panel)` and titled by `titles` (default:
    the panels), saved as `path` in each of `formats` (its suffix replaced); the first file,
    or None, and no file, when nothing was drawn."""
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
    saved = [path.with_suffix(f".{kind}") for kind in formats or ("png",)]
    for target in saved:
        figure.savefig(target, format=target.suffix[1:])
    return saved[0]


# Each run plot: (file, title, y label, in percent, series as (label, VersionRecord field)).
_PLOTS = (
    (
        "accuracy.png",
        "Test accuracy",
        "accuracy (%)",
        True,
        (("global", "global_accuracy"), ("personalised", "personal_accuracy")),
    ),
    (
        "throughput.png",
        "Training throughput",
        "samples / s",
        False,
        (("samples/s", "samples_per_s"),),
    ),
    (
        "loss.png",
        "Loss",
        "loss (test: cross-entropy)",
        False,
        (("train", "train_loss"), ("global test", "global_loss")),
    ),
)


def _round_lines(
    axes: Any, records: Sequence[VersionRecord], lines: Iterable[tuple[str, list[float]]], size: int
) -> bool:
    """Each (label, one value per record) against the round; True when one had data (a line
    without is a metric this algorithm does not report)."""
    drawn = False
    for i, (label, ys) in enumerate(lines):
        if any(math.isfinite(y) for y in ys):
            plot_rounds(axes, i, records, ys, label, size)
            drawn = True
    return drawn


def _series(
    records: Sequence[VersionRecord], percent: bool, series: Sequence[tuple[str, str]]
) -> PanelDraw:
    scale = 100.0 if percent else 1.0

    def draw(axes: Any, _: str) -> bool:
        lines = [
            (label, [float(getattr(r, name)) * scale for r in records]) for label, name in series
        ]
        return _round_lines(axes, records, lines, 4)

    return draw


def _staleness(records: Sequence[VersionRecord]) -> PanelDraw:
    """The staleness histogram of an async run (docs/async.md) as bars, refused updates as the
    last, hatched bar; draws nothing without one."""
    histogram = staleness_histogram(records)

    def draw(axes: Any, _: str) -> bool:
        if histogram is None or sum(histogram.folded.values()) + histogram.refused == 0:
            return False
        taus = list(range(max(histogram.folded, default=0) + 1))
        axes.bar([str(t) for t in taus], [histogram.folded.get(t, 0) for t in taus], label="folded")
        if histogram.refused:
            axes.bar(
                ["refused"], [histogram.refused], hatch="//", color="lightgrey", label="refused"
            )
        axes.set_xlabel("staleness tau = v_now - v_base (versions)")
        return True

    return draw


DEFAULT_PLOTS = PlotSpec()

# The x axes of progress.png: (panel, label, x of each record given the records so far).
_AXES: tuple[tuple[str, str, Callable[[Sequence[VersionRecord]], list[float]]], ...] = (
    ("round", "round", lambda rs: [float(r.round) for r in rs]),
    ("wall-clock", "elapsed (s)", lambda rs: [r.elapsed_s for r in rs]),
    ("samples", "samples trained", lambda rs: list(itertools.accumulate(r.samples for r in rs))),
    (
        "bytes",
        "MiB moved (up + down)",
        lambda rs: [b / 2**20 for b in itertools.accumulate(r.bytes_up + r.bytes_down for r in rs)],
    ),
)


def _progress(records: Sequence[VersionRecord]) -> PanelDraw:
    """Global (and personalised) test accuracy against one of `_AXES` per panel."""
    axes_by_name = {name: (label, xs) for name, label, xs in _AXES}

    def draw(axes: Any, panel: str) -> bool:
        label, xs_of = axes_by_name[panel]
        xs = xs_of(records)
        drawn = False
        for i, (name, column) in enumerate(
            (("global", "global_accuracy"), ("personalised", "personal_accuracy"))
        ):
            ys = [100.0 * float(getattr(r, column)) for r in records]
            if any(math.isfinite(y) for y in ys):
                axes.plot(xs, ys, label=name, markersize=3, **line_style(i))
                drawn = True
        axes.set_xlabel(label)
        return drawn

    return draw


def _algorithm_series(records: Sequence[VersionRecord], patterns: Sequence[str]) -> PanelDraw:
    """The `extra` series matching `patterns` (fnmatch), as percentages, one line each."""
    names = sorted(
        {k for r in records for k in r.extra if any(fnmatch.fnmatch(k, p) for p in patterns)}
    )

    def draw(axes: Any, _: str) -> bool:
        lines = [(name, [100.0 * r.extra.get(name, math.nan) for r in records]) for name in names]
        return _round_lines(axes, records, lines, 3)

    return draw


def write_plots(
    run_dir: Path,
    records: Sequence[VersionRecord],
    *,
    formats: Sequence[str] = ("png",),
    algorithm_plots: Mapping[str, Sequence[str]] | None = None,
) -> list[Path]:
    """The plots that have data, in each of `formats` (the PNG's path listed); an empty run
    has none. `algorithm_plots` are the algorithm's own panels (`Traits.report_plots`):
    title -> patterns of the `extra` series drawn in it, into algorithm.png."""
    if not records:
        return []
    figures: list[tuple[str, str, list[str], PanelDraw, str]] = [
        (file, title, [""], _series(records, percent, series), ylabel)
        for file, title, ylabel, percent, series in _PLOTS
    ]
    progress = "Test accuracy against rounds, time, samples and bytes"
    axes_names = [name for name, _, _ in _AXES]
    figures.append(("progress.png", progress, axes_names, _progress(records), "accuracy (%)"))
    panels = dict(algorithm_plots or {})
    if panels:

        def own(axes: Any, title: str) -> bool:
            return _algorithm_series(records, panels[title])(axes, title)

        figures.append(("algorithm.png", "The algorithm's own metrics", list(panels), own, "%"))
    figures.append((STALENESS_PNG, "Staleness of updates", [""], _staleness(records), "updates"))
    made = [
        panel_figure(run_dir / file, title, names, draw, ylabel=ylabel, formats=formats)
        for file, title, names, draw, ylabel in figures
    ]
    return [p for p in made if p is not None]
