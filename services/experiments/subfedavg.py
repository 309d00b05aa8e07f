"""Sub-FedAvg vs Standalone vs FedAvg (Vahidian et al.): personalised accuracy, model size; the
setup and the metric: `examples/experiments/subfedavg.md`.

Each client's model is the one it holds after its last local training: Sub-FedAvg's pruned
model, as the client reports it (`report.local_accuracy.<client>` in the records), Standalone's
own model (its personal blob) and FedAvg's final global model, both evaluated at the end by
`final_eval`. Parameter and FLOP reductions are each client's last reported ones, averaged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from services.algorithms.base import VersionWeights
from services.config.root import Settings
from services.data.loaders import Dataset
from services.experiments.client_eval import local_test_accuracy
from services.experiments.experiment import Experiment, from_examples
from services.experiments.figures import FigureSlot, plot_band
from services.experiments.results import (
    ResultSet,
    RunResult,
    SeedRuns,
    Spread,
    mean,
    within_spread,
)
from services.experiments.spec import Run, algorithm, smoke
from services.experiments.tables import markdown_table, percent, spread_cell

NAME = "subfedavg"
# (tag, dataset, model)
DATASETS = (("CIFAR-10", "cifar10", "lenet5"), ("MNIST", "mnist", "cnn5"))
STANDALONE, FEDAVG = "Standalone", "FedAvg"
# (method tag, label part, mode, target)
VARIANTS = (
    ("Sub-FedAvg (Un) 30%", "un30", "unstructured", 0.3),
    ("Sub-FedAvg (Un) 50%", "un50", "unstructured", 0.5),
    ("Sub-FedAvg (Un) 70%", "un70", "unstructured", 0.7),
    ("Sub-FedAvg (Hy) 50%", "hy50", "hybrid", 0.5),
    ("Sub-FedAvg (Hy) 70%", "hy70", "hybrid", 0.7),
)
# The paper reports hybrid at 50, 70 and 90% ("for the hybrid pruning we report the accuracy
# results when 50%, 70%, and 90% of the parameters are pruned").
PAPER_VARIANTS = (*VARIANTS, ("Sub-FedAvg (Hy) 90%", "hy90", "hybrid", 0.9))
SUB_METHODS = tuple(v[0] for v in PAPER_VARIANTS)
PAPER_OVER_STANDALONE = 20.0
PAPER_OVER_FEDAVG = 30.0
# The reference scripts' rounds (`script_u.sh`, `script_s.sh`); the text gives none.
REFERENCE_ROUNDS = 300
# Within this many points of the paper's gain we call it close.
CLOSE_POINTS = 5.0


def grid(
    datasets: Sequence[tuple[str, str, str]], variants: Sequence[tuple[str, str, str, float]]
) -> list[Run]:
    runs = []
    for tag, dataset, model in datasets:
        base = {"data": {"dataset": dataset}, "model": {"name": model}}
        short = tag.lower().replace("-", "")
        for method, part, mode, target in variants:
            overrides = base | algorithm("subfedavg", mode=mode, target=target)
            runs.append(
                Run(f"{short}-subfedavg-{part}", {"dataset": tag, "method": method}, overrides)
            )
        for method, name in ((STANDALONE, "standalone"), (FEDAVG, "fedavg")):
            runs.append(
                Run(f"{short}-{name}", {"dataset": tag, "method": method}, base | algorithm(name))
            )
    return runs


def final_eval(settings: Settings, dataset: Dataset, blobs: VersionWeights) -> dict[str, float]:
    """Standalone's and FedAvg's clients on their local test sets. Sub-FedAvg's clients keep
    their masks to themselves (the version holds only the last cohort's masked models), so
    their accuracy comes from what they reported instead."""
    if settings.algorithm.name == "subfedavg":
        return {}
    return local_test_accuracy(settings, dataset, blobs)


def last_per_client(result: RunResult, name: str) -> dict[str, float]:
    """Each client's last reported `<name>.<client>` extra over one run's records."""
    prefix = name + "."
    out: dict[str, float] = {}
    for record in result.records:
        for key, value in record.extra.items():
            if key.startswith(prefix) and "." not in key[len(prefix) :]:
                out[key[len(prefix) :]] = value
    return out


def run_personalised(result: RunResult) -> tuple[float, int]:
    """One run's mean personalised accuracy over the clients and how many clients it covers."""
    if result.algorithm == "subfedavg":
        values = list(last_per_client(result, "local_accuracy").values())
    else:
        final = result.final
        clients = [k[len("local.") :] for k in final if k.startswith("local.")]
        fedavg = result.tags.get("method") == FEDAVG
        # FedAvg: every client holds the global model; Standalone: only those that trained.
        values = [
            final[f"local.{c}"] for c in clients if fedavg or final.get(f"own.{c}", 0.0) == 1.0
        ]
    return mean(values), sum(1 for v in values if math.isfinite(v))


def per_seed(results: ResultSet, dataset: str, method: str) -> list[float]:
    """The method's personalised accuracy per seed, in seed order (empty when not run)."""
    found = results.named(dataset=dataset, method=method)
    return [] if found is None else [run_personalised(r)[0] for r in found.runs]


def personalised(result: SeedRuns) -> tuple[Spread, int]:
    """Personalised accuracy over the seeds, and the fewest clients a seed covers: each seed's
    clients are averaged first (a client's last report differs from seed to seed)."""
    each = [run_personalised(r) for r in result.runs]
    return Spread.of(v for v, _ in each), min(n for _, n in each)


def reduction(result: SeedRuns, name: str) -> float:
    """Mean over clients of their last reported `name`, over the seeds (0 for the unpruned
    baselines)."""
    if result.algorithm != "subfedavg":
        return 0.0
    return mean(mean(last_per_client(r, name).values()) for r in result.runs)


def _value(results: ResultSet, dataset: str, method: str) -> float:
    return mean(per_seed(results, dataset, method))


def gap(results: ResultSet, dataset: str, methods: Sequence[str], other: str) -> Spread:
    """The mean of `methods` minus `other`, paired seed by seed, over the seeds both ran."""
    ours = [per_seed(results, dataset, m) for m in methods]
    ours = [v for v in ours if v]
    base = per_seed(results, dataset, other)
    if not ours or not base:
        return Spread.of([])
    seeds = min(len(base), *(len(v) for v in ours))
    return Spread.of(mean(v[i] for v in ours) - base[i] for i in range(seeds))


def main_table(results: ResultSet) -> str:
    datasets = results.values("dataset")
    columns = ("acc", "− Standalone", "− FedAvg", "params ↓", "FLOPs ↓")
    header = ["method", *(f"{d} {c}" for d in datasets for c in columns)]
    rows = []
    for method in results.values("method"):
        row = [method]
        counted = []
        for d in datasets:
            found = results.named(dataset=d, method=method)
            if found is None:
                row += ["–"] * len(columns)
                continue
            acc, n = personalised(found)
            counted.append(f"{n}")
            own = method in SUB_METHODS
            row += [
                spread_cell(acc),
                spread_cell(gap(results, d, [method], STANDALONE), "+") if own else "",
                spread_cell(gap(results, d, [method], FEDAVG), "+") if own else "",
                percent(reduction(found, "param_reduction")),
                percent(reduction(found, "flop_reduction")),
            ]
        rows.append([*row, " / ".join(counted)])
    over = results.over_seeds(after=", gaps paired seed by seed")
    caption = (
        "**Average personalised accuracy over the clients** (each client's own model on its "
        f"local test set, %; differences in points{over}) **and mean parameter and FLOP "
        "reduction** (%; clients counted per dataset, the fewest over the seeds, in column "
        "order)"
    )
    return markdown_table([*header, "clients counted"], rows, caption)


def _bars(results: ResultSet, slot: FigureSlot) -> str:
    methods = results.values("method")

    def draw(axes: Any, dataset: str) -> bool:
        spreads = [Spread.of(per_seed(results, dataset, m)) for m in methods]
        values = [100 * v.mean for v in spreads]
        if not any(math.isfinite(v) for v in values):
            return False
        colours = ["tab:blue" if m in SUB_METHODS else "tab:grey" for m in methods]
        # One standard deviation over the seeds; none to draw from one seed.
        errors = [100 * v.std if v.count > 1 else 0.0 for v in spreads]
        bars = axes.bar(
            range(len(methods)), values, yerr=errors, capsize=3, color=colours, label="personalised"
        )
        axes.bar_label(bars, fmt="%.1f", fontsize="x-small")
        names = [m.replace("Sub-FedAvg ", "") for m in methods]
        axes.set_xticks(range(len(methods)), names, rotation=45, ha="right", fontsize="small")
        return True

    title = "Average personalised accuracy over the clients" + results.over_seeds(" (", ")")
    return slot.figure("personalised.png", title, results.values("dataset"), draw)


def cohort_metric(result: SeedRuns) -> str:
    """The round's cohort mean personalised accuracy: Sub-FedAvg's reported local accuracy
    after training, the others' aggregator evaluation (Standalone: own model after training;
    FedAvg: the new global model on the cohort's local test sets)."""
    return "local_accuracy" if result.algorithm == "subfedavg" else "personal_accuracy"


def _curves(results: ResultSet, slot: FigureSlot) -> str:
    def draw(axes: Any, dataset: str) -> bool:
        drawn = False
        for i, method in enumerate(results.values("method")):
            found = results.named(dataset=dataset, method=method)
            if found is not None:
                plot_band(axes, i, found, cohort_metric(found), method)
                drawn = True
        return drawn

    title = "Personalised accuracy of each round's cohort" + results.over_seeds(" (", ")")
    return slot.figure("cohort-curves.png", title, results.values("dataset"), draw)


def extras(results: ResultSet, slot: FigureSlot) -> list[str]:
    return [main_table(results), _bars(results, slot), _curves(results, slot)]


def _judge(gain: Spread, paper: float, other: str) -> str:
    """The verdict on a paired gap over seeds: a gap `within_spread` is no lead (one seed: no
    spread to judge it by, said so)."""
    if not math.isfinite(gain.mean):
        return ""
    value = 100 * gain.mean
    if within_spread(gain):
        return f"**disagrees**: within seed spread of {other} (the paper: ≈ +{paper:.0f})"
    lead = "one seed, no spread to judge the gap by; " if gain.count < 2 else ""
    if value <= 0:
        return f"{lead}**disagrees**: Sub-FedAvg is not ahead of {other}"
    if abs(value - paper) <= CLOSE_POINTS:
        return f"{lead}close to the paper's ≈ +{paper:.0f}"
    if value > paper:
        return f"{lead}ahead of {other} by more than the paper's ≈ +{paper:.0f}"
    return f"{lead}ahead of {other}, but **well below** the paper's ≈ +{paper:.0f}"


def _cause(gain: Spread, paper: float, other: str, base: float, rounds: int) -> str:
    """Where the gap to the paper's figure comes from, when it is not close: FedAvg's own
    accuracy can leave less headroom than the paper's lead; against Standalone none of the
    setting differences the section names accounts for a lost lead, only the rounds might."""
    value = 100 * gain.mean
    if not math.isfinite(value) or (value > paper - CLOSE_POINTS and not within_spread(gain)):
        return ""
    headroom = 100 * (1 - base)
    if headroom < paper - CLOSE_POINTS:
        return (
            f" The gap to the paper is **explained**: {other}'s {100 * base:.1f}% leaves at most "
            f"{headroom:.1f} points for any method, so a lead of ≈ +{paper:.0f} cannot occur "
            "here (the paper gives one figure over all its datasets; its Table 2 is not in the "
            "text we have)."
        )
    return (
        " The gap to the paper is **unexplained**: it lies outside seed spread and none of the "
        f"setting differences below accounts for it; only the rounds ({rounds} against the "
        f"reference's {REFERENCE_ROUNDS}) could plausibly change it, and {REFERENCE_ROUNDS} were "
        "not run."
    )


def _fedavg_below_standalone(results: ResultSet, dataset: str) -> str:
    """The paper's remark that FedAvg does worse than Standalone in this setting."""
    below = gap(results, dataset, [FEDAVG], STANDALONE)
    if not math.isfinite(below.mean):
        return ""
    spread = f" ± {100 * below.std:.1f}" if below.count > 1 else ""
    if below.mean < 0 and not within_spread(below):
        word = "agrees with"
    else:
        word = "**disagrees** with"
    return (
        f"{dataset}: FedAvg − Standalone is {100 * below.mean:+.1f}{spread} points; {word} the "
        "paper's remark that in this low-data non-IID setting \"the traditional FedAvg "
        'performs worse than the Standalone".'
    )


def reduction_line(results: ResultSet) -> str:
    """Each variant's mean parameter reduction against its target."""
    parts = []
    for method, _, _, target in PAPER_VARIANTS:
        reached = [
            f"{100 * reduction(found, 'param_reduction'):.1f}% ({dataset})"
            for dataset in results.values("dataset")
            if (found := results.named(dataset=dataset, method=method)) is not None
        ]
        if reached:
            name = method.replace("Sub-FedAvg ", "")
            parts.append(f"{name} (target {100 * target:.0f}%): " + ", ".join(reached))
    return "Mean parameter reduction over the clients: " + "; ".join(parts) + "." if parts else ""


def verdict(results: ResultSet) -> list[str]:
    lines = []
    rounds = max((r.rounds for r in results.runs), default=0)
    for dataset in results.values("dataset"):
        subs = {m: _value(results, dataset, m) for m in SUB_METHODS}
        subs = {m: v for m, v in subs.items() if math.isfinite(v)}
        if not subs:
            continue
        average = mean(subs.values())
        low, high = min(subs.values()), max(subs.values())
        for other, paper in ((STANDALONE, PAPER_OVER_STANDALONE), (FEDAVG, PAPER_OVER_FEDAVG)):
            base = _value(results, dataset, other)
            if not math.isfinite(base):
                continue
            gain = gap(results, dataset, list(subs), other)
            spread = f" ± {100 * gain.std:.1f}" if gain.count > 1 else ""
            lines.append(
                f"{dataset}: Sub-FedAvg's {len(subs)} variants reach {100 * low:.1f}–"
                f"{100 * high:.1f}% (mean {100 * average:.1f}%) against {other}'s "
                f"{100 * base:.1f}%: {100 * gain.mean:+.1f}{spread} points on average "
                f"({100 * (low - base):+.1f} to {100 * (high - base):+.1f}); "
                + _judge(gain, paper, other)
                + "."
                + _cause(gain, paper, other, base, rounds)
            )
        if remark := _fedavg_below_standalone(results, dataset):
            lines.append(remark)
    reached = reduction_line(results)
    return [*lines, reached] if reached else lines


def build() -> Experiment:
    return from_examples(
        NAME,
        runs=grid(DATASETS, VARIANTS),
        paper_runs=grid(DATASETS, PAPER_VARIANTS),
        quick_runs=grid(DATASETS[1:], VARIANTS[1:2]),
        quick=smoke(5, 100, clients={"count": 10, "min_to_start": 10, "fraction": 0.5}),
        verdict=verdict,
        final_eval=final_eval,
        extras=extras,
    )
