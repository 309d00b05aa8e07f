"""MiniBatch-SFL vs SFL-V2 vs FedAvg vs centralized (Huang, Tian, Tang) on Fashion-MNIST; the
setup: `examples/experiments/minibatch_sfl.md`. FedAvg has no cut (one run per r) and the
centralized baseline sees the union of the clients' data, the same for every r (one run).
`--paper`: ResNet-18 on CIFAR-10 (`minibatch_sfl-paper.toml`) over the paper's grid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

from services.experiments.experiment import Experiment, from_examples
from services.experiments.results import (
    SPREAD_FACTOR,
    ResultSet,
    SeedRuns,
    Spread,
    finite,
    paired_gap,
    within_spread,
)
from services.experiments.spec import CurvePlot, FinalPlot, Run, Table, algorithm, smoke

NAME = "minibatch_sfl"
RATIOS = ("0", "0.8", "0.95")
CUTS = ("block1", "block2", "block3")
MBSFL, SFL, FL, CENTRAL = "MiniBatch-SFL", "SFL-V2", "FedAvg", "Centralized"
SPLIT_ALGORITHMS = ((MBSFL, "minibatch_sfl"), (SFL, "sfl_v2"))
ROWS = ("r", "cut")  # of the tables, whose columns are the algorithms
DIFFS = ((MBSFL, SFL), (MBSFL, FL))
PAPER_GAIN_OVER_SFL = 24.1
PAPER_GAIN_OVER_FL = 17.1


# The paper's grid: "r% in {0,0.5,0.8,0.9,0.95}" and "L_c in {1,2,3,4}" (Fig. 2, MiniBatch-SFL
# alone), SFL-V2 beside it at "L_c = 2 for SFL-V2 and MiniBatch-SFL" (Fig. 4). L_c = k is the
# cut after ResNet-18's stage k (the text does not place the cuts; see the paper config).
PAPER_RATIOS = ("0", "0.5", "0.8", "0.9", "0.95")
PAPER_CUTS = ("layer1", "layer2", "layer3", "layer4")
PAPER_SFL_CUTS = ("layer2",)


def grid(
    ratios: tuple[str, ...], cuts: tuple[str, ...], sfl_cuts: tuple[str, ...] | None = None
) -> list[Run]:
    """Per r: both split algorithms at each cut (SFL-V2 only at `sfl_cuts` when given), FedAvg;
    one centralized run."""
    runs = []
    for r in ratios:
        data = {"data": {"ratio": float(r)}}
        for cut in cuts:
            for label, name in SPLIT_ALGORITHMS:
                if label == SFL and sfl_cuts is not None and cut not in sfl_cuts:
                    continue
                overrides = algorithm(name) | data | {"model": {"cut": cut}}
                tags = {"algorithm": label, "r": r, "cut": cut}
                runs.append(Run(f"{name}-r{r}-{cut}", tags, overrides))
        runs.append(Run(f"fedavg-r{r}", {"algorithm": FL, "r": r}, algorithm("fedavg") | data))
    # The union of the clients' data does not depend on r: one centralized run serves all.
    runs.append(Run("centralized", {"algorithm": CENTRAL}, kind="centralized"))
    return runs


def _pairs(results: ResultSet, r: str, other: str) -> Iterator[tuple[str, SeedRuns, SeedRuns]]:
    """(cut, MiniBatch-SFL's run, `other`'s) at `r` for each cut where both ran."""
    for cut in results.values("cut"):
        ours = results.one({"algorithm": MBSFL, "r": r, "cut": cut})
        theirs = results.one({"algorithm": other, "r": r, "cut": cut})
        if ours is not None and theirs is not None:
            yield cut, ours, theirs


def _gains(results: ResultSet, r: str, other: str) -> dict[str, Spread]:
    """MiniBatch-SFL minus `other`, final global accuracy in points, per cut, paired seed by
    seed."""
    out = {}
    for cut, ours, theirs in _pairs(results, r, other):
        gap = paired_gap(ours, theirs, lambda s: s.metric("final_global"))
        if math.isfinite(gap.mean):
            out[cut] = Spread(100.0 * gap.mean, 100.0 * gap.std, gap.count)
    return out


def _listing(gains: dict[str, Spread]) -> str:
    return ", ".join(
        f"{cut} {g.mean:+.1f}" + (f" ± {g.std:.1f}" if g.count > 1 else "")
        for cut, g in gains.items()
    )


def _tied(a: Spread, b: Spread) -> bool:
    """Two gains (points) no further apart than `SPREAD_FACTOR` of the larger std."""
    return abs(b.mean - a.mean) <= SPREAD_FACTOR * max(a.std, b.std)


def _largest_lead(results: ResultSet, r: str, other: str) -> tuple[float, str, int] | None:
    """The largest lead of MiniBatch-SFL over `other` at any round, of the seeds' mean curves:
    (points, cut, round)."""
    best: tuple[float, str, int] | None = None
    for cut, ours, theirs in _pairs(results, r, other):
        for a, b in zip(ours.records, theirs.records, strict=False):
            lead = 100.0 * (a.global_accuracy - b.global_accuracy)
            if math.isfinite(lead) and (best is None or lead > best[0]):
                best = (lead, cut, a.round)
    return best


def _trend(values: list[Spread]) -> str:
    steps = list(itertools.pairwise(values))
    if all(b.mean > a.mean and not _tied(a, b) for a, b in steps):
        return "grows with depth, as the paper says"
    if all(b.mean < a.mean and not _tied(a, b) for a, b in steps):
        return "**shrinks** with depth, the opposite of the paper"
    return "**does not grow** with depth (within seed spread from cut to cut)"


def _against(results: ResultSet, other: str, paper: float) -> list[str]:
    ratios = results.values("r")
    gains = _gains(results, ratios[-1], other) if ratios else {}
    if not gains:
        return []
    high = ratios[-1]
    best_cut = max(gains, key=lambda c: gains[c].mean)
    ahead = sum(1 for g in gains.values() if g.mean > 0 and not within_spread(g))
    seeds = max(g.count for g in gains.values())
    size = "**far below**" if gains[best_cut].mean < paper / 2 else "of the size of"
    over = f" (mean ± std over {seeds} seeds, paired seed by seed)" if seeds > 1 else ""
    lines = [
        f"**vs {other}, r = {high}**: MiniBatch-SFL's final accuracy minus {other}'s, by cut"
        f"{over}: {_listing(gains)} points; ahead beyond seed spread (more than "
        f"{SPREAD_FACTOR:.0f} std) at {ahead} of {len(gains)} cuts. Our largest gain, "
        f"{gains[best_cut].mean:+.1f} (cut {best_cut}), is {size} the paper's up to +{paper}."
    ]
    lead = _largest_lead(results, high, other)
    if lead is not None:
        rounds = max(len(r.records) for r in results)
        lines.append(
            f"vs {other}, r = {high}, at any single round (seeds' mean curves): the largest "
            f"lead is {lead[0]:+.1f} points (cut {lead[1]}, round {lead[2]} of {rounds})."
        )
    if len(gains) > 1:
        lines.append(f"vs {other}, r = {high}: the gain {_trend(list(gains.values()))}.")
    low_gains = _gains(results, ratios[0], other) if ratios[0] != high else {}
    if low_gains:
        low = Spread.of(g.mean for g in low_gains.values())
        top = Spread.of(g.mean for g in gains.values())
        noise = max(g.std for g in (*low_gains.values(), *gains.values()))
        if top.mean - low.mean > SPREAD_FACTOR * noise:
            how = "larger at high non-IID, as the paper says"
        elif low.mean - top.mean > SPREAD_FACTOR * noise:
            how = "**smaller** at high non-IID, the opposite of the paper"
        else:
            how = f"**about the same** (within {SPREAD_FACTOR:.0f} std of the seed spread)"
        lines.append(
            f"vs {other}, mean gain over the cuts: {low.mean:+.1f} points at r = {ratios[0]}, "
            f"{top.mean:+.1f} at r = {high}: {how}."
        )
    return lines


def verdict(results: ResultSet) -> list[str]:
    lines = _against(results, SFL, PAPER_GAIN_OVER_SFL)
    lines += _against(results, FL, PAPER_GAIN_OVER_FL)
    central = results.value("final_global", algorithm=CENTRAL)
    ratios = results.values("r")
    if math.isfinite(central) and ratios:
        high = ratios[-1]
        cuts = results.values("cut")
        ours = finite(results.value("final_global", algorithm=MBSFL, r=high, cut=c) for c in cuts)
        if ours:
            best = max(ours)
            lines.append(
                f"Centralized training on the same data and step budget reaches "
                f"{100 * central:.1f}%; MiniBatch-SFL's best cut at r = {high} reaches "
                f"{100 * best:.1f}% ({100 * (best - central):+.1f} points)."
            )
    return lines


def build() -> Experiment:
    return from_examples(
        NAME,
        runs=grid(RATIOS, CUTS),
        quick_runs=grid(("0.95",), ("block1",)),
        paper_runs=grid(PAPER_RATIOS, PAPER_CUTS, PAPER_SFL_CUTS),
        quick=smoke(),
        tables=(
            Table("Final global test accuracy", ROWS, "algorithm", diffs=DIFFS),
            Table(
                "Best global test accuracy over the rounds", ROWS, "algorithm", "best_global", DIFFS
            ),
        ),
        plots=(
            *(
                CurvePlot(
                    f"curves-{cut}.png",
                    f"Global test accuracy per round, cut after {cut}",
                    "algorithm",
                    "r",
                    where={"cut": cut},
                )
                for cut in (*CUTS, *PAPER_CUTS)
            ),
            FinalPlot(
                "final.png",
                "Final global test accuracy against the non-IID ratio r",
                "r",
                "algorithm",
                "cut",
            ),
        ),
        verdict=verdict,
    )
