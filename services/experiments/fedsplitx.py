"""FedSplitX vs exclusive learning (EXC-level-1, EXC-level-3) and local-loss SFL (Shin et al.);
the setup and the baselines: `examples/experiments/fedsplitx.md`. EXC-level-m runs as
`local_loss_sfl` at cut c_m, whose client side *is* exclusive learning's FedAvg of the level-m
model; its block1 run is also AccSFL's (full model and server FLOPs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from models.registry import build_model
from models.split import SplitNet
from services.aggregator.evaluation import evaluate
from services.algorithms.base import VersionWeights, full_model_weights
from services.algorithms.fedsplitx import level_costs
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Dataset
from services.experiments.experiment import Experiment, from_examples
from services.experiments.figures import FigureSlot
from services.experiments.results import (
    ResultSet,
    SeedRuns,
    ahead_words,
    finite,
    late_mean,
    mean,
    paired_gap,
    swing,
)
from services.experiments.spec import Run, algorithm, smoke
from services.experiments.tables import gap_words, markdown_table, pct, percent, points
from services.report.plots import plot_rounds

NAME = "fedsplitx"
LEVEL_CUTS = ("block1", "block2", "block3")
# The paper setting (`--paper`, fedsplitx-paper.toml): ResNet-18 cut after its first three
# stages. The paper's own partition points are in its Table 3 and Figure 2, not in its text.
PAPER_CUTS = ("layer1", "layer2", "layer3")
CIFAR10_TRAIN_ROWS = 50_000
MIX = (16, 16, 18)
QUICK_MIX = (2, 2, 2)
FEDSPLITX = "FedSplitX"
EXC1 = "EXC-level-1 = local-loss SFL (block1)"
EXC2 = "EXC-level-2"
EXC3 = "EXC-level-3"
ALL3 = "All-level-3 (every client)"
# The runs whose full model (client side + server side) is one of the compared models
# (EXC-level-3's is not: its server side is one layer trained on 18 clients' features).
WITH_FULL_MODEL = (FEDSPLITX, EXC1, ALL3)
# The paper grid's EXC-level-3 run is also AccSFL at c_3 (ResNet-18's server side after layer3
# is layer4 and the classifier): the paper compares its full model with FedSplitX's.
ALSO = "also"
ACCSFL3 = "AccSFL at c_3 (18 clients)"
# `final.json` keys: the whole model, and each client model by the cut it ends at.
FULL_ACCURACY = "full_accuracy"
CLIENT_ACCURACY = "client_accuracy."
LEVEL_FULL_ACCURACY = "full_accuracy."
# Per-round extras written by the FedSplitX strategy (services/algorithms/fedsplitx.py).
SERVER_FLOPS = "server_flops."
LEVEL_OF = "level.client"  # `level.<client id>`: a participant's level that round
# Rounds averaged for the "late" accuracy: a single round's value swings by a few points.
LATE_ROUNDS = 5
PAPER = "arXiv 2310.14579"


def grid(mix: Sequence[int], cuts: Sequence[str] = LEVEL_CUTS, train_rows: int = 0) -> list[Run]:
    """FedSplitX on the population `mix` (clients per level 1, 2, 3) and its baselines, the
    one-level runs at `cuts` (the partition points c_1..c_3 of the base config). With
    `train_rows` (the training split's size), EXC-level-3 trains on the level-3 clients' share
    of it only ("only 18 clients participate"): the excluded clients' data is left out too."""

    def clients(count: int, mix: str = "") -> dict[str, object]:
        return {"clients": {"count": count, "min_to_start": count, "capability_mix": mix}}

    def one_level(cut: str, count: int) -> dict[str, object]:
        return algorithm("local_loss_sfl") | {"model": {"cut": cut}} | clients(count)

    total = sum(mix)

    def kept(clients: int) -> dict[str, object]:
        return {"data": {"train_samples": train_rows * clients // total}} if train_rows else {}

    both = algorithm("fedsplitx") | clients(total, ",".join(str(n) for n in mix))
    exc3_tags = {"method": EXC3, "level": "3"} | ({ALSO: ACCSFL3} if train_rows else {})
    runs = [
        Run("fedsplitx", {"method": FEDSPLITX}, both),
        Run(
            f"exc-level1-local_loss_sfl-{cuts[0]}",
            {"method": EXC1, "level": "1"},
            one_level(cuts[0], total),
        ),
        Run("exc-level3", exc3_tags, one_level(cuts[2], mix[2]) | kept(mix[2])),
        Run("all-level3", {"method": ALL3, "level": "3"}, one_level(cuts[2], total)),
    ]
    if train_rows:
        # The paper's EXC at level 2 too ("level 1, level 2, and level 3"): the 34 clients of
        # levels 2 and 3 train the level-2 model (the scaled grid leaves it out for time).
        capable = mix[1] + mix[2]
        exc2 = one_level(cuts[1], capable) | kept(capable)
        runs.insert(2, Run("exc-level2", {"method": EXC2, "level": "2"}, exc2))
    return runs


def final_eval(settings: Settings, dataset: Dataset, blobs: VersionWeights) -> dict[str, float]:
    """The last version's full model and each level's client model (blocks up to its cut with
    that cut's head) on the whole test set, keyed by the cut."""
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    model: SplitNet = job_model(settings)
    if strategy.server is None:
        raise ValueError(f"{strategy.name} does not split: it has no levels to evaluate")
    cuts = strategy.server.batch_cuts(model, settings.model.cut)
    bound = strategy.for_model(lambda: model, settings.model.cut)
    test = dataset.test
    levels = bound.personal_metrics(model, blobs, test.x, test.y, {})
    out = {FULL_ACCURACY: evaluate(model, full_model_weights(blobs), test).accuracy}
    for m, cut in enumerate(cuts, start=1):
        out[CLIENT_ACCURACY + cut] = levels[f"level{m}.client_accuracy"]
        # The paper's full model per level (w^c to c_m, then w^s); all equal when "merged".
        out[LEVEL_FULL_ACCURACY + cut] = levels[f"level{m}.full_accuracy"]
    return out


def has_full_model(result: SeedRuns) -> bool:
    """Whether the run's full model (client side + server side) is one of the compared ones."""
    return result.tags["method"] in WITH_FULL_MODEL or result.tags.get(ALSO) == ACCSFL3


def run_levels(result: SeedRuns) -> tuple[int, ...]:
    """The levels (1..3) whose client model the run trains, shallow to deep."""
    level = result.tags.get("level")
    return (int(level),) if level else (1, 2, 3)


def accuracy(result: SeedRuns | None, level: int | None) -> float:
    """The final level-`level` client model (the full model for None) on the whole test set
    (NaN: the run has none)."""
    if result is None:
        return math.nan
    if level is None:
        return result.final.get(FULL_ACCURACY, math.nan)
    cut = level_cut(result, level)
    return math.nan if cut is None else result.final.get(CLIENT_ACCURACY + cut, math.nan)


def level_cut(result: SeedRuns, level: int) -> str | None:
    """The cut the run's level-`level` client model ends at: its `final_eval` keys, written
    shallow to deep, one per level the run trains (None: the run has no such model)."""
    cuts = [k.removeprefix(CLIENT_ACCURACY) for k in result.final if k.startswith(CLIENT_ACCURACY)]
    levels = run_levels(result)
    if level not in levels or len(cuts) != len(levels):
        return None
    return cuts[levels.index(level)]


def level_flops(result: SeedRuns | None) -> list[tuple[int, int]]:
    """(client, server) forward FLOPs per sample of each level the run trains, from its report
    (`level<m>.client_flops`); the cnn5's at LEVEL_CUTS when the run recorded none."""
    extra = {} if result is None or not result.records else result.records[0].extra
    levels = () if result is None else run_levels(result)
    found = [
        (int(extra[f"level{m}.client_flops"]), int(extra[f"level{m}.server_flops"]))
        for m in range(1, len(levels) + 1)
        if f"level{m}.client_flops" in extra and f"level{m}.server_flops" in extra
    ]
    if levels and len(found) == len(levels):
        return found
    costs = level_costs(build_model("cnn5"), LEVEL_CUTS)
    return [(c.client_flops, c.server_flops) for c in costs if c.level in levels or not levels]


def _method(results: ResultSet, method: str) -> SeedRuns | None:
    return results.named(need="", method=method)


def level_curve(result: SeedRuns, level: int | None) -> list[float]:
    """The level-`level` client model's accuracy per round on the evaluation rows (record key
    `level<m>` is the run's m-th level); the full model's for None."""
    if level is None:
        return result.curve()
    levels = run_levels(result)
    return (
        result.curve(f"level{levels.index(level) + 1}.client_accuracy") if level in levels else []
    )


def server_flops(result: SeedRuns | None) -> float:
    """Mean server forward FLOPs per trained sample over the run: the mean over every
    (round, participant) of the FLOPs the server spends on that client's rows (each trains the
    same number of rows a round)."""
    records = () if result is None else result.records
    return mean(v for r in records for k, v in r.extra.items() if k.startswith(SERVER_FLOPS))


def population(result: SeedRuns | None) -> tuple[int, ...]:
    """The run's clients per declared level (its `clients.capability_mix`); () if none."""
    clients = {} if result is None else result.run.overrides.get("clients", {})
    return tuple(int(n) for n in clients.get("capability_mix", "").split(",") if n)


def _clients_line(result: SeedRuns) -> str:
    mix = population(result)
    count = result.run.overrides.get("clients", {}).get("count", "?")
    if mix:
        return f"{count} (levels 1/2/3: {'/'.join(map(str, mix))})"
    return f"{count} (all at level {result.tags.get('level', '?')})"


def model_rows(result: SeedRuns) -> list[tuple[int | None, float]]:
    """The models a run yields: (level, or None for the full model; final accuracy on the
    whole test set)."""
    levels: list[int | None] = list(run_levels(result))
    if has_full_model(result):
        levels.append(None)
    return [(level, accuracy(result, level)) for level in levels]


def accuracy_table(results: ResultSet) -> str:
    """One row per (run, model it yields): the final version on the whole test set."""
    fed = _method(results, FEDSPLITX)
    fed_full = accuracy(fed, None)
    header = ["method", "clients (levels)", "model evaluated", "client fwd FLOPs/sample"]
    header += ["final accuracy %", f"mean of last {LATE_ROUNDS} rounds %", "best over rounds %"]
    header += ["this − FedSplitX same model", "FedSplitX full − this"]
    rows: list[list[str]] = []
    for result in results:
        for level, acc in model_rows(result):
            if level is None:
                what, flops, same = "full model (client side + server side)", "", fed_full
            else:
                cut = level_cut(result, level) or "?"
                own_flops = level_flops(result)[run_levels(result).index(level)][0]
                what = f"level-{level} client model (blocks to {cut} + head)"
                flops, same = f"{own_flops:,}", accuracy(fed, level)
            curve = level_curve(result, level)
            own = result is fed
            rows.append(
                [
                    result.tags["method"],
                    _clients_line(result),
                    what,
                    flops,
                    percent(acc),
                    percent(late_mean(curve, LATE_ROUNDS)),
                    percent(max(finite(curve), default=math.nan)),
                    "" if own else points(acc - same),
                    "" if own and level is None else points(fed_full - acc),
                ]
            )
    caption = (
        "**Accuracy of every model the runs yield** (final version on all 10,000 test images; "
        f"the mean of the last {LATE_ROUNDS} rounds and the best round on the evaluation rows; "
        "differences in points, from the final accuracies)"
    )
    return markdown_table(header, rows, caption)


def flops_table(results: ResultSet) -> str:
    """Server forward FLOPs per trained sample, as measured over the runs' rows."""
    fed = _method(results, FEDSPLITX)
    early = _method(results, EXC1)
    costs = level_flops(fed)
    cuts = [level_cut(fed, m) if fed is not None else None for m in (1, 2, 3)]
    names = [c or cnn5 for c, cnn5 in zip(cuts, LEVEL_CUTS, strict=True)]
    reference = server_flops(early)
    header = ["method", "clients (levels)", "server fwd FLOPs/sample (measured)"]
    header += ["relative to local-loss SFL block1", "samples trained"]
    header += ["server training GFLOPs (≈ 3 × fwd)", "bytes up / sample"]
    rows = []
    for result in results:
        flops = server_flops(result)
        samples = sum(r.samples for r in result.records)
        up = sum(r.bytes_up for r in result.records) / samples if samples else math.nan
        rows.append(
            [
                result.tags["method"],
                _clients_line(result),
                f"{flops:,.0f}" if math.isfinite(flops) else "–",
                f"{flops / reference:.1%}" if math.isfinite(flops / reference) else "–",
                f"{samples:,}",
                f"{3 * flops * samples / 1e9:,.1f}" if math.isfinite(flops) else "–",
                f"{up:,.0f}",
            ]
        )
    per_level = ", ".join(
        f"level {m} ({cut}): client {client:,} / server {server:,}"
        for m, (cut, (client, server)) in enumerate(zip(names, costs, strict=False), start=1)
    )
    alone = level_flops(early)[0][1] if early is not None else costs[0][1]
    caption = (
        "**Server compute** (forward FLOPs per trained sample, from each round's "
        "`server_flops.<client>`; a training step costs about three forwards). Per level, "
        f"forward FLOPs per sample: {per_level}; local-loss SFL at {names[0]} leaves the "
        f"server {alone:,}."
    )
    mix = population(fed)
    if fed is not None and mix:
        draws = [int(v) for r in fed.records for k, v in r.extra.items() if k.startswith(LEVEL_OF)]
        # The server's expected forward FLOPs per sample for `mix` training equal rows.
        expected = sum(n * c[1] for n, c in zip(mix, costs, strict=True)) / sum(mix)
        caption += (
            f" For FedSplitX's population ({'/'.join(map(str, mix))} clients at levels 1/2/3) "
            f"training equal rows the expected mean is {expected:,.0f}; "
            f"its {len(draws)} (round, participant) pairs were at levels 1/2/3 "
            f"{'/'.join(str(draws.count(m)) for m in (1, 2, 3))} times."
        )
    return markdown_table(header, rows, caption)


def _curves(results: ResultSet, slot: FigureSlot) -> str:
    panels = [f"level-{m} client model" for m in (1, 2, 3)] + ["full model"]

    def draw(axes: Any, panel: str) -> bool:
        drawn = False
        for i, result in enumerate(results):
            full = panel == "full model"
            if full and not has_full_model(result):
                continue
            ys = [100 * v for v in level_curve(result, None if full else int(panel[6]))]
            if ys:
                plot_rounds(axes, i, result.records, ys, result.tags["method"])
                drawn = True
        return drawn

    return slot.figure("curves.png", "Test accuracy per round (evaluation rows)", panels, draw)


def _bars(results: ResultSet, slot: FigureSlot) -> str:
    short = {EXC1: "EXC-1/AccSFL", ALL3: "All-3"}

    def values(panel: str) -> list[tuple[int, str, float]]:
        """(run index, bar label, value) of one panel."""
        out: list[tuple[int, str, float]] = []
        for i, result in enumerate(results):
            method = result.tags["method"]
            if panel == "server FLOPs":
                name = short.get(method, method.replace("-level-", "-"))
                out.append((i, name, server_flops(result) / 1e3))
                continue
            for level, acc in model_rows(result):
                out.append((i, "full" if level is None else f"L{level}", 100 * acc))
        return out

    def draw(axes: Any, panel: str) -> bool:
        bars = values(panel)
        if not any(math.isfinite(v) for _, _, v in bars):
            return False
        for i, result in enumerate(results):
            xs = [x for x, (run, _, _) in enumerate(bars) if run == i]
            if xs:
                ys = [bars[x][2] for x in xs]
                drawn = axes.bar(xs, ys, color=f"C{i}", label=result.tags["method"])
                axes.bar_label(drawn, fmt="%.1f" if panel == "accuracy" else "%.0f", fontsize=7)
        axes.set_xticks(range(len(bars)), [label for _, label, _ in bars], fontsize="small")
        axes.set_ylabel("final accuracy (%)" if panel == "accuracy" else "kFLOPs / sample")
        # Room for the legend above the bars.
        axes.set_ylim(0, 1.6 * max(v for _, _, v in bars if math.isfinite(v)))
        return True

    title = "Final accuracy (whole test set) and server forward FLOPs per sample"
    return slot.figure("final.png", title, ["accuracy", "server FLOPs"], draw, ylabel="")


def extras(results: ResultSet, slot: FigureSlot) -> list[str]:
    return [
        accuracy_table(results),
        flops_table(results),
        _curves(results, slot),
        _bars(results, slot),
    ]


def _late(result: SeedRuns, level: int | None) -> str:
    return pct(late_mean(level_curve(result, level), LATE_ROUNDS))


def _exc_lines(fed: SeedRuns, exc: SeedRuns, level: int) -> list[str]:
    name = f"EXC-level-{level}"
    full, theirs = accuracy(fed, None), accuracy(exc, level)
    lines = []
    if math.isfinite(full - theirs):
        gap = paired_gap(fed, exc, lambda s: accuracy(s, None), lambda s: accuracy(s, level))
        judged = ahead_words(
            gap,
            "agrees: FedSplitX is",
            "**disagrees**: FedSplitX is not",
            "**disagrees**: within seed spread, FedSplitX is not clearly",
        )
        late = f"mean of the last {LATE_ROUNDS} rounds {_late(fed, None)} vs {_late(exc, level)}"
        lines.append(
            f"FedSplitX's full model {pct(full)} vs {name}'s global model (the level-{level} "
            f"model) {pct(theirs)} ({gap_words(gap)}; {late}): {judged} ahead of {name}."
        )
    own = accuracy(fed, level)
    if math.isfinite(own - theirs):
        gap = paired_gap(fed, exc, lambda s: accuracy(s, level))
        word = ahead_words(
            gap, "better", "**not better**", "**not clearly better** (within seed spread)"
        )
        lines.append(
            f"Level-{level} client model: FedSplitX's {pct(own)} vs {name}'s {pct(theirs)} "
            f"({gap_words(gap)}; mean of the last {LATE_ROUNDS} rounds "
            f"{_late(fed, level)} vs {_late(exc, level)}): the client-side model "
            f"FedSplitX gives level-{level} clients is {word} than the one exclusive learning "
            "trains."
        )
    return lines


def _accsfl_lines(fed: SeedRuns, accsfl: SeedRuns) -> list[str]:
    lines = []
    ours, theirs = server_flops(fed), server_flops(accsfl)
    if math.isfinite(ours) and math.isfinite(theirs) and theirs > 0:
        judged = (
            "agrees, FedSplitX leaves the server less work" if ours < theirs else "**disagrees**"
        )
        lines.append(
            f"Server load: FedSplitX {ours:,.0f} forward FLOPs per sample vs local-loss SFL at "
            f"block1 {theirs:,.0f} ({ours / theirs:.0%}): {judged}."
        )
    full, acc_full = accuracy(fed, None), accuracy(accsfl, None)
    if math.isfinite(acc_full) and math.isfinite(full):
        gap = paired_gap(fed, accsfl, lambda s: accuracy(s, None))
        word = ahead_words(gap, "ahead of", "**behind**", "**level with** (within seed spread)")
        lines.append(
            f"Full model: FedSplitX {pct(full)} vs local-loss SFL at block1 {pct(acc_full)} "
            f"({gap_words(gap)}; mean of the last {LATE_ROUNDS} rounds "
            f"{_late(fed, None)} vs {_late(accsfl, None)}): FedSplitX is {word} "
            "local-loss SFL with the early cut, whose server trains everything after block1 "
            "on every row."
        )
    return lines


def verdict(results: ResultSet) -> list[str]:
    fed = _method(results, FEDSPLITX)
    if fed is None:
        return []
    lines: list[str] = []
    for method, level in ((EXC1, 1), (EXC3, 3)):
        if (exc := _method(results, method)) is not None:
            lines += _exc_lines(fed, exc, level)
    if (accsfl := _method(results, EXC1)) is not None:
        lines += _accsfl_lines(fed, accsfl)
    exc3 = _method(results, EXC3)
    if exc3 is not None and exc3.tags.get(ALSO) == ACCSFL3:
        full, theirs = accuracy(fed, None), accuracy(exc3, None)
        if math.isfinite(full - theirs):
            gap = paired_gap(fed, exc3, lambda s: accuracy(s, None))
            word = ahead_words(
                gap,
                "agrees: FedSplitX is ahead",
                "**disagrees**: it is not",
                "**disagrees**: within seed spread, not clearly ahead",
            )
            lines.append(
                f"Full model at depth-level 3: FedSplitX {pct(full)} vs {ACCSFL3} "
                f'{pct(theirs)} ({gap_words(gap)}): {word} (the paper: FedSplitX "achieves '
                'better performance as it involves a larger number of participating clients").'
            )
    swings = [
        f"{r.tags['method']} {100 * swing(r.curve()):.1f} points"
        for r in results
        if has_full_model(r)
    ]
    if len(swings) >= 2:
        lines.append(
            "Round-to-round swing of the full model's accuracy (mean absolute change, "
            "evaluation rows, seeds' mean curve): " + ", ".join(swings) + "."
        )
    all3, exc3_ = _method(results, ALL3), _method(results, EXC3)
    every, capable = accuracy(all3, 3), accuracy(exc3_, 3)
    if all3 is not None and exc3_ is not None and math.isfinite(every - capable):
        gap = paired_gap(all3, exc3_, lambda s: accuracy(s, 3))
        lines.append(
            f"What exclusion costs at level 3: all clients at level 3 reach {pct(every)} with "
            f"the level-3 model, the capable clients alone {pct(capable)} ({gap_words(gap)})."
        )
    return lines


def build() -> Experiment:
    return from_examples(
        NAME,
        runs=grid(MIX),
        quick_runs=grid(QUICK_MIX),
        paper_runs=grid(MIX, PAPER_CUTS, train_rows=CIFAR10_TRAIN_ROWS),
        quick=smoke(clients={"fraction": 1.0}),
        verdict=verdict,
        final_eval=final_eval,
        extras=extras,
    )
