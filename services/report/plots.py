"""PNG plots of a run: accuracy, throughput and loss per round.

Figures are built on matplotlib's object API with an explicit Agg canvas: no pyplot, so no
global figure registry, no GUI backend and no rcParams change in whoever imports this.
matplotlib is imported on first use: only the process that writes the report pays for it
(every `splitmq` role process imports this module through the CLI).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.report.records import VersionRecord
from services.report.summary import staleness_histogram

# (marker, line style, marker fill) per series of one plot.
_STYLES = (("o", "-", "full"), ("s", "--", "none"))

ACCURACY_PNG = "accuracy.png"
THROUGHPUT_PNG = "throughput.png"
LOSS_PNG = "loss.png"
STALENESS_PNG = "staleness.png"


def _axes(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    """A figure on an Agg canvas of its own, and its one axes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    return figure, axes


def _save(figure: Any, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


# Each run plot: (file, title, y label, in percent, series as (label, VersionRecord field)).
_PLOTS = (
    (
        ACCURACY_PNG,
        "Test accuracy",
        "accuracy (%)",
        True,
        (("global", "global_accuracy"), ("personalised", "personal_accuracy")),
    ),
    (
        THROUGHPUT_PNG,
        "Training throughput",
        "samples / s",
        False,
        (("samples/s", "samples_per_s"),),
    ),
    (
        LOSS_PNG,
        "Loss",
        "cross-entropy",
        False,
        (("train", "train_loss"), ("global test", "global_loss")),
    ),
)


def _plot(
    path: Path,
    records: Sequence[VersionRecord],
    title: str,
    ylabel: str,
    percent: bool,
    series: Sequence[tuple[str, str]],
) -> Path | None:
    from matplotlib.ticker import MaxNLocator

    xs = [r.round + 1 for r in records]  # counted from 1, as in the summary
    figure, axes = _axes(title, "round", ylabel)
    drawn = False
    for (label, name), (marker, line, fill) in zip(series, _STYLES, strict=False):
        ys = [float(getattr(r, name)) * (100.0 if percent else 1.0) for r in records]
        if not any(math.isfinite(y) for y in ys):
            continue  # a metric this algorithm does not report
        # Distinct markers and dashes: equal series (global = personal for SFL) stay visible.
        axes.plot(xs, ys, label=label, marker=marker, linestyle=line, fillstyle=fill)
        drawn = True
    if not drawn:
        return None
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(True, alpha=0.3)
    if len(series) > 1:
        axes.legend()
    return _save(figure, path)


def write_plots(run_dir: Path, records: Sequence[VersionRecord]) -> list[Path]:
    """The plots that have data; an empty run has none."""
    if not records:
        return []
    made = [
        _plot(run_dir / file, records, title, ylabel, percent, series)
        for file, title, ylabel, percent, series in _PLOTS
    ]
    # Async runs only (docs/async.md): how stale the folded updates were.
    made.append(write_staleness_plot(run_dir / STALENESS_PNG, records))
    return [p for p in made if p is not None]


def write_staleness_plot(path: Path, records: Sequence[VersionRecord]) -> Path | None:
    """The staleness histogram of an async run as a bar chart (refused updates as the last,
    hatched bar); None without one."""
    histogram = staleness_histogram(records)
    if histogram is None or histogram.total == 0:
        return None
    taus = list(range(max(histogram.folded, default=0) + 1))
    xlabel = "staleness tau = v_now - v_base (versions)"
    figure, axes = _axes("Staleness of updates", xlabel, "updates")
    axes.bar([str(t) for t in taus], [histogram.folded.get(t, 0) for t in taus], label="folded")
    if histogram.refused:
        axes.bar(["refused"], [histogram.refused], hatch="//", color="lightgrey", label="refused")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend()
    return _save(figure, path)
