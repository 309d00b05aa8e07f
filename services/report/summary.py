"""The human-readable views of a run: banner, one progress line per version, summary table.

Rounds are numbered from 1 here ("round 1/3"), as people count; metrics.json and metrics.csv
keep the protocol's numbering, which starts at 0.

An async run's staleness histogram is read from its records' extras (docs/async.md, "Metrics:
the staleness histogram"); a sync run's records have none.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.report.records import OWN_MODEL_ACCURACY, VersionRecord
from services.report.rundir import RunInfo

STALENESS_PREFIX = "staleness."
REFUSED = "too_stale"


@dataclass(frozen=True)
class StalenessHistogram:
    folded: dict[int, int]  # tau -> updates folded with that staleness
    refused: int  # updates refused as too stale

    def line(self) -> str:
        bins = ", ".join(f"{t}: {c}" for t, c in sorted(self.folded.items()))
        n = sum(self.folded.values())
        mean = sum(t * c for t, c in self.folded.items()) / n if n else 0.0
        return f"{bins}; refused {self.refused} (mean {mean:.2f})"


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


# More rows than this and the table shows the first and last few, to stay on one screen.
_MAX_ROWS = 12
_HEAD_ROWS = 4


def pct(value: float) -> str:
    return "   n/a" if not math.isfinite(value) else f"{100.0 * value:5.1f}%"


def num(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.3f}"


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GiB"


def banner(info: RunInfo) -> str:
    cut = f"cut {info.cut}" if info.cut else "no split"
    if info.cut.startswith("levels"):
        cut = info.cut
    line = (
        f"splitmq: job {info.job} | {info.model} ({cut}) | {info.algorithm} | "
        f"{info.clients} clients | {info.dataset} | S={info.shards} | {info.rounds} rounds"
    )
    if info.torch_threads:  # 0: a run from before the thread budget
        line += (
            f"\ntorch threads: {info.torch_threads} intra-op / {info.torch_interop_threads} "
            f"inter-op per compute thread ({info.thread_budget})"
        )
    if info.schedule:  # "": a run from before issue 36
        line += f"\nschedule: {info.schedule} (seed {info.seed})"
    return line


def progress_line(record: VersionRecord, rounds: int = 0) -> str:
    of = f"/{rounds}" if rounds else ""
    return (
        f"round {record.round}{of}  v{record.version}  global {pct(record.global_accuracy)}  "
        f"personal {pct(record.personal_accuracy)}  loss {num(record.train_loss)}  "
        f"{record.samples_per_s:,.0f} samples/s  {record.elapsed_s:.1f}s"
    )


@dataclass(frozen=True)
class Totals:
    final_global: float
    best_global: float
    best_global_round: int
    final_personal: float
    best_personal: float
    total_s: float
    median_samples_per_s: float
    samples: int
    bytes_up: int
    bytes_down: int

    @classmethod
    def of(cls, records: Sequence[VersionRecord]) -> Totals | None:
        if not records:
            return None
        best = max(records, key=lambda r: finite_or(r.global_accuracy, -1.0))
        personal = [r.personal_accuracy for r in records if math.isfinite(r.personal_accuracy)]
        return cls(
            final_global=records[-1].global_accuracy,
            best_global=best.global_accuracy,
            best_global_round=best.round,
            final_personal=records[-1].personal_accuracy,
            best_personal=max(personal) if personal else math.nan,
            total_s=max(r.elapsed_s for r in records),
            median_samples_per_s=statistics.median(r.samples_per_s for r in records),
            samples=sum(r.samples for r in records),
            bytes_up=sum(r.bytes_up for r in records),
            bytes_down=sum(r.bytes_down for r in records),
        )


def _own_line(records: Sequence[VersionRecord]) -> list[str]:
    """The papers' personalised metric, where the clients report it (`OWN_MODEL_ACCURACY`)."""
    own = records[-1].extra.get(OWN_MODEL_ACCURACY, math.nan)
    if not math.isfinite(own):
        return []
    return [
        f"  own-model accuracy       {pct(own).strip()}   (the papers' personalised metric: "
        "each client's model after its local training, all clients that trained)"
    ]


def finite_or(value: float, default: float = -math.inf) -> float:
    return value if math.isfinite(value) else default


def _table(records: Sequence[VersionRecord]) -> list[str]:
    lines = ["  round  version  global acc  personal acc  train loss  samples/s  elapsed"]
    shown: list[VersionRecord | None] = list(records)
    if len(records) > _MAX_ROWS:
        tail = _MAX_ROWS - _HEAD_ROWS - 1
        shown = [*records[:_HEAD_ROWS], None, *records[-tail:]]
    for r in shown:
        if r is None:
            lines.append("  ...")
            continue
        lines.append(
            f"  {r.round:>5}  {r.version:>7}  {pct(r.global_accuracy):>10}  "
            f"{pct(r.personal_accuracy):>12}  {num(r.train_loss):>10}  "
            f"{r.samples_per_s:>9,.0f}  {r.elapsed_s:>6.1f}s"
        )
    return lines


def summary_text(
    info: RunInfo,
    records: Sequence[VersionRecord],
    run_dir: Path | None = None,
    wall_s: float | None = None,
) -> str:
    """The one-screen summary printed at the end of a run and stored as summary.txt."""
    lines = [banner(info), f"status: {info.status}", ""]
    totals = Totals.of(records)
    if totals is None:
        lines.append("no version was published")
    else:
        lines.extend(_table(records))
        total_s = wall_s if wall_s is not None else totals.total_s
        lines += [
            "",
            f"  final global accuracy    {pct(totals.final_global).strip()}"
            f"   (best {pct(totals.best_global).strip()} in round {totals.best_global_round})",
            f"  final personal accuracy  {pct(totals.final_personal).strip()}"
            f"   (best {pct(totals.best_personal).strip()})",
            *_own_line(records),
            f"  total time               {total_s:.1f} s",
            f"  samples/s (median)       {totals.median_samples_per_s:,.0f}"
            f"   ({totals.samples:,} samples trained)",
            f"  bytes up / down          {size(totals.bytes_up)} / {size(totals.bytes_down)}",
        ]
        stale = staleness_histogram(records)
        if stale is not None:
            lines.append(f"  staleness (async)        {stale.line()}")
    if run_dir is not None:
        lines.append(f"  run directory            {run_dir}")
    return "\n".join(lines) + "\n"
