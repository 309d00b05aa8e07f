"""The staleness histogram of an asynchronous run, from its records (docs/async.md).

Each async version's record counts the updates it folded by staleness (`extra["staleness.<tau>"]`)
and the updates refused as too stale since the previous version (`extra["too_stale"]`). A sync
run's records have neither, and no histogram.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.report.records import VersionRecord

STALENESS_PREFIX = "staleness."
REFUSED = "too_stale"
STALENESS_PNG = "staleness.png"


@dataclass(frozen=True)
class StalenessHistogram:
    folded: dict[int, int]  # tau -> updates folded with that staleness
    refused: int  # updates refused as too stale

    @property
    def total(self) -> int:
        return sum(self.folded.values()) + self.refused

    @property
    def mean(self) -> float:
        n = sum(self.folded.values())
        return sum(t * c for t, c in self.folded.items()) / n if n else 0.0

    def line(self) -> str:
        bins = ", ".join(f"{t}: {c}" for t, c in sorted(self.folded.items()))
        return f"{bins}; refused {self.refused} (mean {self.mean:.2f})"


def staleness_histogram(records: Sequence[VersionRecord]) -> StalenessHistogram | None:
    """The run's histogram, or None for a run without async records."""
    folded: Counter[int] = Counter()
    refused = 0
    seen = False
    for record in records:
        for key, value in record.extra.items():
            tail = key[len(STALENESS_PREFIX) :]
            if key.startswith(STALENESS_PREFIX) and tail.isdigit():
                folded[int(tail)] += int(value)
                seen = True
        if REFUSED in record.extra:
            refused += int(record.extra[REFUSED])
            seen = True
    return StalenessHistogram(dict(sorted(folded.items())), refused) if seen else None


def write_staleness_plot(
    path: Path, records: Sequence[VersionRecord], *, title: str = "Staleness of updates"
) -> Path | None:
    """A bar chart of the histogram (refused updates as the last, hatched bar); None without
    one. matplotlib's object API, as in `services.report.plots`."""
    histogram = staleness_histogram(records)
    if histogram is None or histogram.total == 0:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    top = max(histogram.folded, default=0)
    taus = list(range(top + 1))
    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    axes.bar([str(t) for t in taus], [histogram.folded.get(t, 0) for t in taus], label="folded")
    if histogram.refused:
        axes.bar(["refused"], [histogram.refused], hatch="//", color="lightgrey", label="refused")
    axes.set_title(title)
    axes.set_xlabel("staleness tau = v_now - v_base (versions)")
    axes.set_ylabel("updates")
    axes.grid(True, axis="y", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    return path
