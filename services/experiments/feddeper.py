"""FedDeper vs FedAvg (Zhou, Li, Tang, Wang) on Fashion-MNIST, pathological non-IID shards; the
setup: `examples/experiments/feddeper.md`. Personalised accuracy: FedDeper's v_k on its client's
local test set (reported by the clients); FedAvg has no personal model, so its personalised
number is the global model on each participant's local test set (the aggregator's evaluation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from services.experiments.experiment import Experiment, from_examples
from services.experiments.figures import FigureSlot
from services.experiments.results import (
    ResultSet,
    SeedRuns,
    Spread,
    ahead_words,
    finite,
    late_mean,
    mean,
    paired_gap,
    swing,
    within_spread,
)
from services.experiments.spec import CurvePlot, Metric, Run, Table, algorithm, smoke
from services.experiments.tables import gap_words, markdown_table, pct, pts, spread_cell
from services.report.records import OWN_MODEL_ACCURACY

NAME = "feddeper"
FEDAVG = "FedAvg"
RHOS = ("0.1", "1")
# n -> fraction sampled per round; shards are sized so n clients x 2 shards use all 60,000
# training images (3,000 per shard at n = 10, 300 at n = 100).
POPULATIONS = (("10", 1.0), ("100", 0.1))
TRAIN_IMAGES = 60_000
SHARDS_PER_CLIENT = 2
# `VersionRecord.extra` key: FedDeper's global model on the participants' local test sets,
# FedAvg's personalised number measured the same way (services/aggregator/metrics.py).
GLOBAL_ON_LOCAL = "global_personal_accuracy"
# Rounds averaged for the "late" accuracy: the final value alone swings by several points
# from round to round under label-skewed sampling.
LATE_ROUNDS = 5
# A run publishing no version for this long is stopped (`Experiment.stall_s`): a diverged
# model's NaN updates are refused by every client and its round reopens until
# rounds.max_empty_attempts fail the job (6 deadlines). Above the round deadline (120 s) plus a
# slow round on a busy host.
STALL_S = 240.0
# A final train loss this many times the run's lowest one: the run diverged.
DIVERGED = 100.0


def feddeper_label(rho: str) -> str:
    return f"FedDeper rho={rho}"


def grid(populations: Sequence[tuple[str, float]], rhos: Sequence[str]) -> list[Run]:
    runs = []
    for n, fraction in populations:
        count = int(n)
        base = {
            "clients": {"count": count, "min_to_start": count, "fraction": fraction},
            "data": {"shard_size": TRAIN_IMAGES // (SHARDS_PER_CLIENT * count)},
        }
        runs.append(Run(f"fedavg-n{n}", {"n": n, "method": FEDAVG}, base | algorithm("fedavg")))
        for rho in rhos:
            tags = {"n": n, "method": feddeper_label(rho), "rho": rho}
            overrides = base | algorithm("feddeper", rho=float(rho))
            runs.append(Run(f"feddeper-n{n}-rho{rho}", tags, overrides))
    return runs


def global_on_local(result: SeedRuns) -> float:
    """Last round's global model on its participants' local test sets: FedDeper records it
    in `extra`, FedAvg as its personalised accuracy."""
    if not result.records:
        return math.nan
    last = result.records[-1]
    return last.extra.get(GLOBAL_ON_LOCAL, last.personal_accuracy)


def _global_lines(n: str, fedavg: SeedRuns, deper: SeedRuns, label: str) -> list[str]:
    ours, theirs = deper.curve(), fedavg.curve()
    late = paired_gap(deper, fedavg, lambda s: late_mean(s.curve(), LATE_ROUNDS))
    # The mean over all rounds: higher when sooner there.
    speed = paired_gap(deper, fedavg, lambda s: mean(s.curve()))
    if not math.isfinite(late.mean + speed.mean):
        return []
    if within_spread(late) and within_spread(speed):
        word = "is within seed spread of FedAvg: no evidence for"
    elif late.mean > 0 and speed.mean > 0:
        word = "agrees with"
    elif late.mean <= 0 and speed.mean <= 0:
        word = "**disagrees** with"
    else:
        word = "is mixed evidence for"
    return [
        f"n = {n}, {label}, aggregated model: mean global accuracy over the last "
        f"{LATE_ROUNDS} rounds {pct(late_mean(ours, LATE_ROUNDS))} vs FedAvg "
        f"{pct(late_mean(theirs, LATE_ROUNDS))} ({gap_words(late)}); over all rounds (speed of "
        f"convergence) {pct(mean(ours))} vs {pct(mean(theirs))} ({gap_words(speed)}): {word} "
        f"the claim of faster convergence. Round-to-round swing {pct(swing(ours))} vs "
        f"{pct(swing(theirs))}."
    ]


def own_model(result: SeedRuns) -> float:
    """The paper's personalised metric ("the personalized models' performance (v_i) in local
    testing"): every client's latest v_k on its local test set, averaged over all clients
    (`extra.own_model_accuracy`); for FedAvg, which has no v_k, the final global model on the
    last cohort's local test sets."""
    if not result.records:
        return math.nan
    last = result.records[-1]
    if result.algorithm == "feddeper":
        return last.extra.get(OWN_MODEL_ACCURACY, math.nan)
    return last.personal_accuracy


def own_spread(result: SeedRuns) -> Spread:
    """`own_model` of each seed's run read alone (seeds may end at different rounds: a
    diverged one stops early), over the seeds."""
    return Spread.of(own_model(SeedRuns((r,))) for r in result.runs)


def own_model_table(results: ResultSet) -> str:
    methods = results.values("method")
    header = ["n", *methods, *(f"{m} − {FEDAVG}" for m in methods if m != FEDAVG)]
    rows = []
    for n in results.values("n"):
        found = {m: results.named(n=n, method=m) for m in methods}
        cells = [spread_cell(own_spread(f)) if f else "–" for f in found.values()]
        base = found.get(FEDAVG)
        gaps = [
            spread_cell(paired_gap(f, base, own_model), "+") if f and base else "–"
            for m, f in found.items()
            if m != FEDAVG
        ]
        rows.append([n, *cells, *gaps])
    over = results.over_seeds(after=", gaps paired seed by seed")
    caption = (
        "**Own-model accuracy, the paper's personalised metric** (FedDeper: every client's "
        "latest v_k on its local test set, averaged over all clients that trained, not only "
        "the last round's; FedAvg: the final global model on the last cohort's local test sets; "
        f"%, differences in points{over})"
    )
    return markdown_table(header, rows, caption)


def _personal_lines(n: str, fedavg: SeedRuns, deper: SeedRuns, label: str) -> list[str]:
    personal = late_mean(deper.curve("personal_accuracy"), LATE_ROUNDS)
    baseline = late_mean(fedavg.curve("personal_accuracy"), LATE_ROUNDS)
    if not math.isfinite(personal + baseline):
        return []
    own = paired_gap(deper, fedavg, own_model)
    headline = ""
    if math.isfinite(own.mean):
        judged = ahead_words(own, "ahead, as the paper says", "**behind**", "within seed spread")
        headline = (
            f"own-model accuracy (every client's latest v_k) {pct(own_spread(deper).mean)} vs "
            f"FedAvg's global model on local test sets {pct(own_spread(fedavg).mean)} "
            f"({gap_words(own)}): {judged}. The last rounds' participants alone: "
        )
    return [
        f"n = {n}, {label}, personalised: {headline}v_k on local test sets {pct(personal)} "
        f"(mean of the last {LATE_ROUNDS} rounds) vs FedAvg's global model on the same kind "
        f"of sets {pct(baseline)} ({pts(personal - baseline)}); FedDeper's own global model "
        f"on its last round's local test sets: {pct(global_on_local(deper))}."
    ]


def short_rounds(result: SeedRuns) -> list[int]:
    """The rounds (from 1) that closed with fewer participants than the run's fullest round
    (a client dropped, late, or refused to send: its numbers rest on a smaller cohort)."""
    fullest = max((r.participants for r in result.records), default=0)
    return [r.round for r in result.records if r.participants < fullest]


def participation(results: ResultSet) -> list[str]:
    short = {r.label: rounds for r in results if (rounds := short_rounds(r))}
    if not short:
        return ["Every round of every run closed with its full cohort."]
    listing = "; ".join(
        f"`{label}` round(s) {', '.join(map(str, rounds))}" for label, rounds in short.items()
    )
    return [f"Rounds that closed with a smaller cohort than the run's fullest: {listing}."]


def unfinished(result: SeedRuns) -> str | None:
    """A sentence on a run that did not complete its rounds, else None."""
    if result.complete:
        return None
    losses = finite(result.curve("train_loss"))
    sentence = (
        f"`{result.label}` did not finish ({result.status} after {len(result.records)} of "
        f"{result.rounds} rounds; a run is stopped on Ctrl-C or when it publishes no version "
        f"for {STALL_S:.0f} s)"
    )
    if losses and losses[-1] >= DIVERGED * min(losses):
        sentence += (
            f": its aggregated model had diverged, train loss {min(losses):.3g} at best and "
            f"{losses[-1]:.3g} in its last round"
        )
    return sentence + "."


def verdict(results: ResultSet) -> list[str]:
    lines: list[str] = participation(results) if len(results) else []
    lines += [s for r in results if (s := unfinished(r))]
    for n in results.values("n"):
        fedavg = results.one({"n": n, "method": FEDAVG})
        for rho in results.values("rho"):
            deper = results.named(n=n, rho=rho)
            if fedavg is None or deper is None:
                continue
            lines += _global_lines(n, fedavg, deper, feddeper_label(rho))
            lines += _personal_lines(n, fedavg, deper, feddeper_label(rho))
    return lines


def extras(results: ResultSet, slot: FigureSlot) -> list[str]:
    return [own_model_table(results)]


def build() -> Experiment:
    methods = (FEDAVG, *(feddeper_label(r) for r in RHOS))
    diffs = tuple((m, FEDAVG) for m in methods[1:])

    def table(title: str, metric: Metric = "final_global", with_diffs: bool = True) -> Table:
        return Table(title, ("n",), "method", metric, diffs if with_diffs else (), methods)

    return from_examples(
        NAME,
        runs=grid(POPULATIONS, RHOS),
        quick_runs=grid((("10", 1.0),), RHOS[:1]),
        quick=smoke(),
        tables=(
            table("Final global test accuracy (aggregated model, whole test set)"),
            table(
                "Final personalised accuracy of the last round's participants (FedDeper: their "
                "v_k on local test sets; FedAvg: global model on local test sets)",
                "final_personal",
            ),
            table("Best global test accuracy over the rounds", "best_global", with_diffs=False),
        ),
        plots=(
            CurvePlot("global.png", "Global test accuracy per round", "method", "n"),
            CurvePlot(
                "personal.png",
                "Personalised accuracy per round (FedAvg: global model on local tests)",
                "method",
                "n",
                metric="personal_accuracy",
            ),
        ),
        verdict=verdict,
        extras=extras,
        stall_s=STALL_S,
    )
