"""PNG plots of a run (accuracy, throughput, loss and staleness per round) and `panel_figure`,
the row of panels that they and the experiments' figures are drawn on.

Figures are built on matplotlib's object API with an explicit Agg canvas: no pyplot, so no
global figure registry, no GUI backend and no rcParams change in whoever imports this.
matplotlib is imported on first use: only the process that writes the report pays for it
(every `splitmq` role process imports this module through the CLI).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.report.records import VersionRecord
from services.report.summary import staleness_histogram

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")
_LINES = ("-", "--", "-.", ":")

STALENESS_PNG = "staleness.png"

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
        "cross-entropy",
        False,
        (("train", "train_loss"), ("global test", "global_loss")),
    ),
)


def _series(
    records: Sequence[VersionRecord], percent: bool, series: Sequence[tuple[str, str]]
) -> PanelDraw:
    def draw(axes: Any, _: str) -> bool:
        drawn = False
        for i, (label, name) in enumerate(series):
            ys = [float(getattr(r, name)) * (100.0 if percent else 1.0) for r in records]
            if any(math.isfinite(y) for y in ys):  # else a metric this algorithm does not report
                plot_rounds(axes, i, records, ys, label, 4)
                drawn = True
        return drawn

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


def write_plots(run_dir: Path, records: Sequence[VersionRecord]) -> list[Path]:
    """The plots that have data; an empty run has none."""
    if not records:
        return []
    made = [
        panel_figure(run_dir / file, title, [""], _series(records, percent, series), ylabel=ylabel)
        for file, title, ylabel, percent, series in _PLOTS
    ]
    staleness = _staleness(records)
    made.append(
        panel_figure(
            run_dir / STALENESS_PNG, "Staleness of updates", [""], staleness, ylabel="updates"
        )
    )
    return [p for p in made if p is not None]
