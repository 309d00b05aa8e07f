"""SplitGP vs local-only vs FedAvg vs multi-exit (lam = 0) vs SFL (Han et al.), MNIST and FMNIST;
the setup: `examples/experiments/splitgp.md`. Each client is tested on a mix of its own classes
(share 1 - p) and the others (share p): accuracy(p) = (1 - p) * local + p * ood, from every
client's final model (`final_eval`). SplitGP and multi-exit answer by split inference at E_th,
the others by their whole model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.algorithms.base import VersionWeights
from services.algorithms.splitgp import SplitGPSection, version_metrics
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Dataset
from services.experiments.client_eval import all_clients, local_and_ood
from services.experiments.experiment import Experiment, from_examples
from services.experiments.figures import FigureSlot
from services.experiments.results import (
    EXPERIMENT_JSON,
    SPREAD_FACTOR,
    ResultSet,
    SeedRuns,
    Spread,
)
from services.experiments.spec import Run, smoke
from services.experiments.tables import markdown_table, percent, spread_cell
from services.report.plots import line_style
from services.report.summary import finite_or

NAME = "splitgp"
DATASETS = (("MNIST", "mnist"), ("FMNIST", "fashion_mnist"))
SPLITGP, MULTI_EXIT, SFL = "SplitGP", "Multi-exit (λ=0)", "SFL"
FEDAVG, LOCAL = "FedAvg", "Local-only"
# (method tag, label part, algorithm overrides)
METHODS: tuple[tuple[str, str, Mapping[str, Any]], ...] = (
    (SPLITGP, "splitgp", {"name": "splitgp"}),
    (MULTI_EXIT, "multiexit", {"name": "splitgp", "splitgp": {"lam": 0.0}}),
    (SFL, "sfl", {"name": "sfl_v2"}),
    (FEDAVG, "fedavg", {"name": "fedavg"}),
    (LOCAL, "local", {"name": "standalone"}),
)
# At the paper's setting theta is one copy per client aggregated by alpha_k (the paper's
# SplitFed [26], which SplitGP is at gamma = 0): the SFL baseline keeps the same server side.
PAPER_METHODS = tuple(
    (method, part, {"name": "sfl_v1"} if method == SFL else algorithm)
    for method, part, algorithm in METHODS
)
SPLIT_INFERENCE = (SPLITGP, MULTI_EXIT)
P_VALUES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
# Test rows of the final evaluation: the first FINAL_ROWS of the test set (about a fifth are
# a client's own classes), fewer when 10 x eval_samples is smaller (the --quick grid).
FINAL_ROWS = 1000
# E_th of the final sweep, nats; ln 10 = 2.303 is the most a 10-class softmax can have, so the
# last keeps every row on the client.
SWEEP = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 2.31)
SWEEP_P = (0.0, 0.2, 0.5, 0.8, 1.0)


def grid(
    datasets: Sequence[tuple[str, str]],
    methods: Sequence[str] = (),
    table: Sequence[tuple[str, str, Mapping[str, Any]]] = METHODS,
) -> list[Run]:
    return [
        Run(
            f"{dataset}-{part}",
            {"dataset": tag, "method": method},
            {"data": {"dataset": dataset}, "algorithm": dict(algorithm)},
        )
        for tag, dataset in datasets
        for method, part, algorithm in table
        if not methods or method in methods
    ]


def final_eval(settings: Settings, dataset: Dataset, blobs: VersionWeights) -> dict[str, float]:
    """Every client's final model on the first `FINAL_ROWS` test images, split into its own
    classes and the others: the whole model (`full_*`) and, for SplitGP, the head, theta and
    split inference at E_th and at every E_th of `SWEEP` (`splitgp.*`)."""
    test = dataset.test
    rows = min(FINAL_ROWS, 10 * settings.data.eval_samples or FINAL_ROWS)
    x, y = test.x[:rows], test.y[:rows]
    clients = all_clients(settings, dataset)
    model = job_model(settings)
    if settings.algorithm.name != "splitgp":
        full = local_and_ood(model, blobs, x, y, clients)
        return {k: v for k, v in full.items() if k.startswith("full_")}
    threshold = settings.algorithm.section(SplitGPSection).entropy_threshold
    out = version_metrics(model, blobs, x, y, clients, threshold=threshold, sweep=SWEEP)
    # theta(phi_k(x)) is the whole model of a SplitGP client.
    out["full_local"] = out.get("splitgp.theta_local", math.nan)
    out["full_ood"] = out.get("splitgp.theta_ood", math.nan)
    return out


def mix(local: float, ood: float, p: float) -> float:
    """Accuracy on a test mix with a share `p` out of distribution."""
    return (1 - p) * local + p * ood


def inference(result: SeedRuns) -> tuple[float, float]:
    """(local, ood) accuracy of the method's own inference: split inference at E_th for
    SplitGP and multi-exit, the whole model for the others."""
    return result.pair("splitgp.split" if result.tags.get("method") in SPLIT_INFERENCE else "full")


def best_threshold(result: SeedRuns, p: float) -> tuple[float, float]:
    """(accuracy, E_th) of the sweep's best threshold at `p` (chosen on the test rows); of
    equally good ones the largest, which offloads the fewest rows."""
    best = (math.nan, math.nan)
    for t, acc in zip(SWEEP, _sweep(result, "split", p), strict=True):
        if math.isfinite(acc) and not acc < best[0]:
            best = (acc, t)
    return best


def per_p(found: SeedRuns, values: Callable[[SeedRuns], list[float]]) -> list[Spread]:
    """`values` (one per p) of each seed's run read alone, as a spread over the seeds per p."""
    each = [values(SeedRuns((run,))) for run in found.runs]
    return [Spread.of(v[i] for v in each) for i in range(len(P_VALUES))]


def _mixed(prefix: str) -> Callable[[SeedRuns], list[float]]:
    """The accuracy at each p of the final evaluation's `<prefix>_local`/`_ood` pair."""
    return lambda s: [mix(*s.pair(prefix), p) for p in P_VALUES]


def curve_rows(results: ResultSet, dataset: str) -> list[tuple[str, list[Spread]]]:
    """(line, accuracy at each p over the seeds): each method's own inference, then SplitGP's
    variants."""
    rows = []
    for method in results.values("method"):
        found = results.named("final", dataset=dataset, method=method)
        if found is not None:
            rows.append((method, per_p(found, lambda s: [mix(*inference(s), p) for p in P_VALUES])))
    splitgp = results.named("final", dataset=dataset, method=SPLITGP)
    if splitgp is not None:
        for name, prefix in (("head only", "splitgp.head"), ("whole model", "full")):
            rows.append((f"{SPLITGP}, {name}", per_p(splitgp, _mixed(prefix))))
        best = per_p(splitgp, lambda s: [best_threshold(s, p)[0] for p in P_VALUES])
        rows.append((f"{SPLITGP}, best E_th per p", best))
    return rows


def p_table(results: ResultSet, dataset: str) -> str:
    header = ["method", *(f"p={p:g}" for p in P_VALUES)]
    body = [
        [name, *(spread_cell(v) for v in values)] for name, values in curve_rows(results, dataset)
    ]
    over = results.over_seeds()
    caption = (
        f"**{dataset}: accuracy (%) against the out-of-distribution share p of the test mix** "
        "(mean over all clients of their final models; SplitGP and multi-exit by split "
        f"inference at the configured E_th, the others by their whole model{over})"
    )
    return markdown_table(header, body, caption)


def _sweep(found: SeedRuns, what: str, p: float) -> list[float]:
    """Split inference's `what` (split: accuracy, offload: share offloaded) at each E_th of
    the sweep, on the test mix with a share `p` out of distribution."""
    return [mix(*found.pair(f"splitgp.sweep.{t:g}.{what}"), p) for t in SWEEP]


def sweep_table(results: ResultSet, dataset: str) -> str:
    found = results.named("final", dataset=dataset, method=SPLITGP)
    if found is None:
        return ""
    header = ["E_th", *(f"acc p={p:g}" for p in SWEEP_P), *(f"offloaded p={p:g}" for p in SWEEP_P)]
    columns = [_sweep(found, what, p) for what in ("split", "offload") for p in SWEEP_P]
    body = [[f"{t:g}", *(percent(c[i]) for c in columns)] for i, t in enumerate(SWEEP)]
    caption = (
        f"**{dataset}: SplitGP's E_th sweep** (accuracy and share of test rows offloaded to the "
        "server, %, at out-of-distribution share p)"
    )
    return markdown_table(header, body, caption)


def _p_figure(results: ResultSet, slot: FigureSlot) -> str:
    def draw(axes: Any, dataset: str) -> bool:
        drawn = False
        for i, (name, spreads) in enumerate(curve_rows(results, dataset)):
            values = [100 * v.mean for v in spreads]
            if any(math.isfinite(v) for v in values):
                axes.plot(P_VALUES, values, label=name, **line_style(i))
                drawn = True
        axes.set_xlabel("out-of-distribution share p")
        return drawn

    title = "Accuracy against the out-of-distribution share of the test mix"
    return slot.figure("accuracy-vs-p.png", title, results.values("dataset"), draw)


def _sweep_figure(results: ResultSet, slot: FigureSlot) -> str:
    def draw(axes: Any, dataset: str) -> bool:
        found = results.named("final", dataset=dataset, method=SPLITGP)
        if found is None:
            return False
        for i, p in enumerate(SWEEP_P):
            offloaded = [100 * o for o in _sweep(found, "offload", p)]
            accuracy = [100 * a for a in _sweep(found, "split", p)]
            axes.plot(offloaded, accuracy, label=f"p={p:g}", **line_style(i))
        axes.set_xlabel("rows offloaded to the server (%)")
        return True

    title = "SplitGP: accuracy against the share offloaded (E_th from 0 to 2.31 nats)"
    return slot.figure("eth-sweep.png", title, results.values("dataset"), draw)


def extras(results: ResultSet, slot: FigureSlot) -> list[str]:
    blocks = []
    for dataset in results.values("dataset"):
        blocks += [p_table(results, dataset), sweep_table(results, dataset)]
    return [*blocks, _p_figure(results, slot), _sweep_figure(results, slot)]


def verdict(results: ResultSet) -> list[str]:
    lines = []
    for dataset in results.values("dataset"):
        rows = dict(curve_rows(results, dataset))
        ours = rows.get(SPLITGP)
        others = {m: v for m, v in rows.items() if m in (MULTI_EXIT, SFL, FEDAVG, LOCAL)}
        if ours is None or not others:
            continue
        lost: list[str] = []
        tied: list[str] = []
        margins: list[float] = []
        for i, p in enumerate(P_VALUES):
            best = max(others, key=lambda m: finite_or(others[m][i].mean))
            mine, theirs = ours[i], others[best][i]
            margins.append(100 * (mine.mean - finite_or(theirs.mean)))
            if mine.mean >= theirs.mean:
                continue
            where = (
                f"p={p:g} ({best} {100 * theirs.mean:.1f}% vs {100 * mine.mean:.1f}%, "
                f"{100 * (mine.mean - theirs.mean):+.1f})"
            )
            noise = SPREAD_FACTOR * max(mine.std, theirs.std)
            (tied if theirs.mean - mine.mean <= noise else lost).append(where)
        span = (
            f"margin over the best other method {min(margins):+.1f} to {max(margins):+.1f} points"
        )
        if lost:
            judged = f"is **not** best at every p ({span}); beaten at {'; '.join(lost)}"
        elif tied:
            judged = (
                f"is **not clearly** best at every p ({span}); within seed spread of the best "
                f"other at {'; '.join(tied)}"
            )
        else:
            judged = f"is the most accurate at every p ({span}): agrees with the paper"
        if lost and tied:
            judged += f"; within seed spread at {'; '.join(tied)}"
        lines.append(f"{dataset}: SplitGP {judged}.")
    return lines + offload_lines(results)


def configured_threshold(result: SeedRuns) -> float:
    """The run's E_th, from the config its experiment.json recorded (kept with the archived
    runs too; NaN when unreadable)."""
    try:
        doc = json.loads((result.run_dir / EXPERIMENT_JSON).read_text(encoding="utf-8"))
        return float(doc["config"]["algorithm"]["splitgp"]["entropy_threshold"])
    except (OSError, KeyError, ValueError, TypeError):
        return math.nan


def offload_lines(results: ResultSet) -> list[str]:
    """How much split inference at the configured E_th sent to the server."""
    lines = []
    for dataset in results.values("dataset"):
        found = results.named("final", dataset=dataset, method=SPLITGP)
        if found is None:
            continue
        local, ood = found.pair("splitgp.offload")
        if not (math.isfinite(local) and math.isfinite(ood)):
            continue
        line = (
            f"{dataset}: at E_th = {configured_threshold(found):g} nats split "
            f"inference offloads {100 * local:.1f}% of a client's own-class rows and "
            f"{100 * ood:.1f}% of the others"
        )
        if local > 0.9:
            line += (
                ": the heads are rarely that sure this early in training, so SplitGP answers "
                f"nearly everything with theta(phi_k) (own classes: head alone "
                f"{100 * found.pair('splitgp.head')[0]:.1f}%, whole model "
                f"{100 * found.pair('full')[0]:.1f}%)"
            )
        lines.append(line + ".")
    return lines


def build() -> Experiment:
    return from_examples(
        NAME,
        runs=grid(DATASETS),
        paper_runs=grid(DATASETS, table=PAPER_METHODS),
        quick_runs=grid(DATASETS[:1], (SPLITGP, SFL, LOCAL)),
        quick=smoke(3, 30, clients={"count": 6, "min_to_start": 6}),
        verdict=verdict,
        final_eval=final_eval,
        extras=extras,
    )
