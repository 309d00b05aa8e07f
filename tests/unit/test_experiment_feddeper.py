"""The FedDeper experiment without training: its grid, and the verdict's numbers."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from services.experiments import feddeper
from services.experiments.results import ResultSet, RunResult, late_mean, mean, swing
from services.experiments.runner import build_settings
from services.experiments.spec import Run
from services.report.records import OWN_MODEL_ACCURACY, VersionRecord


def record(i: int, global_acc: float, personal: float, extra: dict[str, float]) -> VersionRecord:
    return VersionRecord(
        version=i + 2,
        round=i + 1,  # round index i is round i + 1, as records count them
        elapsed_s=float(i + 1),
        participants=10,
        global_accuracy=global_acc,
        global_loss=1.0,
        personal_accuracy=personal,
        train_loss=1.0,
        train_accuracy=0.5,
        samples=10,
        samples_per_s=10.0,
        bytes_up=0,
        bytes_down=0,
        extra=extra,
    )


def result(
    tags: dict[str, str],
    global_accs: list[float],
    personal: list[float],
    extra: dict[str, float] | None = None,
) -> RunResult:
    records = tuple(
        record(i, g, p, dict(extra or {}))
        for i, (g, p) in enumerate(zip(global_accs, personal, strict=True))
    )
    return RunResult(
        run=Run(f"run-{len(global_accs)}-{tags}", tags),
        run_dir=Path("/nowhere"),
        status="finished",
        wall_s=1.0,
        rounds=len(records),
        records=records,
    )


def test_grid_is_n10_all_and_n100_sampled_with_a_rho_sweep() -> None:
    experiment = feddeper.build()
    seen = set()
    for run in experiment.runs:
        s = build_settings(experiment, run, quick=False, data_dir=None)
        n = int(run.tags["n"])
        assert s.clients.count == s.clients.min_to_start == n
        assert s.clients.fraction == (1.0 if n == 10 else 0.1)
        assert (s.data.dataset, s.data.partition, s.data.shards_per_client) == (
            "fashion_mnist",
            "shards",
            2,
        )
        # Every training image is dealt: n clients x 2 shards.
        assert n * 2 * s.data.shard_size == 60_000
        if run.tags["method"] == feddeper.FEDAVG:
            assert s.algorithm.name == "fedavg" and "rho" not in run.tags
        else:
            assert s.algorithm.name == "feddeper"
            assert s.algorithm.feddeper.rho == float(run.tags["rho"])
            assert s.algorithm.feddeper.lam == 0.5
        seen.add((run.tags["n"], run.tags["method"]))
    methods = {feddeper.FEDAVG, "FedDeper rho=0.1", "FedDeper rho=1"}
    assert seen == {(n, m) for n in ("10", "100") for m in methods}


def test_quick_is_smaller_than_the_real_grid() -> None:
    experiment = feddeper.build()
    run = experiment.quick_runs[0]
    full = build_settings(experiment, run, quick=False, data_dir=None)
    quick = build_settings(experiment, run, quick=True, data_dir=None)
    assert quick.job.rounds < full.job.rounds
    assert quick.algorithm.max_steps_per_round < full.algorithm.max_steps_per_round


def test_summaries_of_a_run() -> None:
    run = result({"n": "10"}, [0.1, 0.3, 0.2, 0.6, 0.5, 0.7, 0.8], [0.5] * 7)
    assert mean(run.curve()) == pytest.approx(3.2 / 7)
    late = late_mean(run.curve(), feddeper.LATE_ROUNDS)
    assert late == pytest.approx((0.2 + 0.6 + 0.5 + 0.7 + 0.8) / 5)
    # |0.2| + |0.1| + |0.4| + |0.1| + |0.2| + |0.1| over 6 steps
    assert swing(run.curve()) == pytest.approx(1.1 / 6)
    assert feddeper.global_on_local(run) == 0.5  # FedAvg: its personalised number
    deper = result({"n": "10"}, [0.1], [0.9], {feddeper.GLOBAL_ON_LOCAL: 0.4})
    assert feddeper.global_on_local(deper) == 0.4
    empty = result({"n": "10"}, [], [])
    assert math.isnan(mean(empty.curve())) and math.isnan(swing(empty.curve()))


def test_verdict_compares_each_rho_with_fedavg_of_the_same_n() -> None:
    fedavg = result({"n": "10", "method": "FedAvg"}, [0.2, 0.4, 0.6], [0.3, 0.5, 0.7])
    better = result(
        {"n": "10", "method": "FedDeper rho=0.1", "rho": "0.1"},
        [0.3, 0.5, 0.7],
        [0.8, 0.9, 1.0],
        {feddeper.GLOBAL_ON_LOCAL: 0.65},
    )
    worse = result(
        {"n": "10", "method": "FedDeper rho=1", "rho": "1"},
        [0.1, 0.2, 0.3],
        [0.4, 0.5, 0.6],
    )
    lines = feddeper.verdict(ResultSet([fedavg, better, worse]))
    assert len(lines) == 5
    full, rho01_global, rho01_personal, rho1_global, rho1_personal = lines
    assert full == "Every round of every run closed with its full cohort."
    assert "rho=0.1" in rho01_global and "agrees with the claim" in rho01_global
    assert "50.0% vs FedAvg 40.0% (+10.0 points, one seed)" in rho01_global
    assert "90.0%" in rho01_personal and "50.0% (+40.0 points)" in rho01_personal
    assert "last round's local test sets: 65.0%" in rho01_personal
    assert "**disagrees** with the claim" in rho1_global
    assert "(-20.0 points, one seed)" in rho1_global
    assert "(+0.0 points)" in rho1_personal


def test_own_model_accuracy_is_every_clients_latest_v_k_beside_fedavgs_global_model() -> None:
    def seeded(method: str, name: str, personal: float, own: float, seed: int) -> RunResult:
        base = result({"n": "100", "method": method}, [0.5], [personal])
        records = tuple(
            replace(r, extra={**r.extra, OWN_MODEL_ACCURACY: own}) for r in base.records
        )
        run = Run(base.run.label, base.run.tags, {"algorithm": {"name": name}})
        return replace(base, run=run, records=records, seed=seed)

    runs = []
    for seed, (own, fed) in enumerate(((0.90, 0.60), (0.94, 0.62))):
        # FedAvg's headline is its global model on the local test sets, not its clients'
        # fine-tuned models (0.0 here).
        runs.append(seeded(feddeper.FEDAVG, "fedavg", fed, 0.0, seed))
        # The last cohort's v_k (0.99) is not the headline: every client's latest v_k is.
        runs.append(seeded("FedDeper rho=1", "feddeper", 0.99, own, seed))
    table = feddeper.own_model_table(ResultSet(runs))
    assert "| 100 | 61.0 ± 1.4 | 92.0 ± 2.8 | +31.0 ± 1.4 |" in table
    assert "mean ± std over 2 seeds" in table


def test_verdict_without_fedavg_compares_nothing() -> None:
    alone = result({"n": "100", "method": "FedDeper rho=1", "rho": "1"}, [0.5], [0.9])
    assert feddeper.verdict(ResultSet([alone])) == [
        "Every round of every run closed with its full cohort."
    ]
    assert feddeper.verdict(ResultSet([])) == []


def test_rounds_with_a_smaller_cohort_are_named() -> None:
    run = result({"n": "10"}, [0.1, 0.2, 0.3], [0.5] * 3)
    shrunk = replace(run, records=(run.records[0], replace(run.records[1], participants=7)))
    assert feddeper.short_rounds(run) == []
    assert feddeper.short_rounds(shrunk) == [2]
    assert feddeper.participation(ResultSet([run, shrunk])) == [
        "Rounds that closed with a smaller cohort than the run's fullest: "
        f"`{shrunk.label}` round(s) 2."
    ]


def test_an_unfinished_run_is_named_and_a_divergence_said() -> None:
    diverged = replace(result({"n": "10"}, [0.5, 0.6, 0.1], [0.9] * 3), status="stopped", rounds=30)
    diverged = replace(
        diverged,
        records=tuple(
            replace(r, train_loss=loss)
            for r, loss in zip(diverged.records, [0.5, 0.3, 40.0], strict=True)
        ),
    )
    sentence = feddeper.unfinished(diverged)
    assert sentence is not None
    assert f"`{diverged.label}` did not finish (stopped after 3 of 30 rounds" in sentence
    assert "diverged, train loss 0.3 at best and 40 in its last round" in sentence
    stalled = replace(diverged, records=diverged.records[:2])
    assert "diverged" not in (feddeper.unfinished(stalled) or "")
    finished = result({"n": "10"}, [0.5], [0.9])
    assert feddeper.unfinished(finished) is None
