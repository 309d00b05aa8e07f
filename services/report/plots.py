"""PNG plots of a run: accuracy, throughput and loss per round.

Figures are built on matplotlib's object API with an explicit Agg canvas: no pyplot, so no
global figure registry, no GUI backend and no rcParams change in whoever imports this.
matplotlib is imported on first use: only the process that writes the report pays for it
(every `splitmq` role process imports this module through the CLI).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from services.report.records import VersionRecord
from services.report.staleness import STALENESS_PNG, write_staleness_plot

Series = tuple[str, Callable[[VersionRecord], float]]

# (marker, line style, marker fill) per series of one plot.
_STYLES = (("o", "-", "full"), ("s", "--", "none"))

ACCURACY_PNG = "accuracy.png"
THROUGHPUT_PNG = "throughput.png"
LOSS_PNG = "loss.png"


def _plot(
    path: Path,
    records: Sequence[VersionRecord],
    series: Sequence[Series],
    *,
    title: str,
    ylabel: str,
    percent: bool = False,
) -> Path | None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    xs = [r.round + 1 for r in records]  # counted from 1, as in the summary
    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    drawn = False
    for (label, value), (marker, line, fill) in zip(series, _STYLES, strict=False):
        ys = [value(r) * (100.0 if percent else 1.0) for r in records]
        if not any(math.isfinite(y) for y in ys):
            continue  # a metric this algorithm does not report
        # Distinct markers and dashes: equal series (global = personal for SFL) stay visible.
        axes.plot(xs, ys, label=label, marker=marker, linestyle=line, fillstyle=fill)
        drawn = True
    if not drawn:
        return None
    axes.set_title(title)
    axes.set_xlabel("round")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    if len(series) > 1:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path


def write_plots(run_dir: Path, records: Sequence[VersionRecord]) -> list[Path]:
    """The plots that have data; an empty run has none."""
    if not records:
        return []
    made = [
        _plot(
            run_dir / ACCURACY_PNG,
            records,
            [
                ("global", lambda r: r.global_accuracy),
                ("personalised", lambda r: r.personal_accuracy),
            ],
            title="Test accuracy",
            ylabel="accuracy (%)",
            percent=True,
        ),
        _plot(
            run_dir / THROUGHPUT_PNG,
            records,
            [("samples/s", lambda r: r.samples_per_s)],
            title="Training throughput",
            ylabel="samples / s",
        ),
        _plot(
            run_dir / LOSS_PNG,
            records,
            [("train", lambda r: r.train_loss), ("global test", lambda r: r.global_loss)],
            title="Loss",
            ylabel="cross-entropy",
        ),
        # Async runs only (docs/async.md): how stale the folded updates were.
        write_staleness_plot(run_dir / STALENESS_PNG, records),
    ]
    return [p for p in made if p is not None]
