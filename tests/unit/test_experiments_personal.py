"""The personalised-accuracy experiments (Sub-FedAvg, SplitGP) without training: every client's
model on its own classes and the others, the numbers each experiment derives from its runs,
and the harness's `final_eval` / `extras` hooks."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from broker.store import CLIENT_PART, BlobRef
from models.registry import build_model
from services.experiments import splitgp, subfedavg
from services.experiments.client_eval import local_and_ood
from services.experiments.document import Context, write_results
from services.experiments.experiment import Experiment
from services.experiments.figures import FigureSlot
from services.experiments.results import (
    EXPERIMENT_JSON,
    FINAL_JSON,
    ResultSet,
    RunResult,
    SeedRuns,
    load_result,
)
from services.experiments.spec import Run
from services.report.records import VersionRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def constant_model_state(label: int) -> dict[str, torch.Tensor]:
    """cnn5 weights that answer `label` for every input: a zero classifier with a one-hot bias."""
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in build_model("cnn5").state_dict().items()}
    state = {k: v for k, v in state.items() if k.startswith("blocks.")}
    state["blocks.3.fc.weight"].zero_()
    state["blocks.3.fc.bias"].copy_(torch.nn.functional.one_hot(torch.tensor(label), 10))
    return state


def test_each_client_is_tested_with_its_own_model_else_the_global_one() -> None:
    blobs = {
        BlobRef(CLIENT_PART): constant_model_state(0),
        BlobRef(CLIENT_PART, "client-1"): constant_model_state(1),
    }
    x = torch.randn(6, 1, 28, 28)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    clients = {"client-0": [0], "client-1": [1], "client-2": [2]}
    out = local_and_ood(build_model("cnn5"), blobs, x, y, clients)
    # client-0 (global: always 0): its 2 rows right, none of the 4 others.
    assert (out["local.client-0"], out["ood.client-0"]) == (1.0, 0.0)
    # client-1 (its own model: always 1): the same on its class.
    assert (out["local.client-1"], out["ood.client-1"]) == (1.0, 0.0)
    # client-2 (global): none of its class 2; the two 0-rows among its 4 others.
    assert (out["local.client-2"], out["ood.client-2"]) == (0.0, 0.5)
    assert out["full_local"] == pytest.approx(2 / 3)
    assert out["full_ood"] == pytest.approx(1 / 6)


def record(round_index: int, extra: dict[str, float], personal: float = math.nan) -> VersionRecord:
    return VersionRecord(
        version=round_index + 2,
        round=round_index,
        elapsed_s=1.0,
        participants=2,
        global_accuracy=0.1,
        global_loss=2.0,
        personal_accuracy=personal,
        train_loss=1.0,
        train_accuracy=0.5,
        samples=10,
        samples_per_s=10.0,
        bytes_up=0,
        bytes_down=0,
        extra=extra,
    )


def run_result(
    method: str,
    algorithm: str,
    records: tuple[VersionRecord, ...] = (),
    final: dict[str, float] | None = None,
    dataset: str = "MNIST",
) -> RunResult:
    return RunResult(
        run=Run(
            f"{dataset}-{method}",
            {"dataset": dataset, "method": method},
            {"algorithm": {"name": algorithm}},
        ),
        run_dir=Path("/nowhere"),
        status="finished",
        wall_s=1.0,
        rounds=len(records),
        records=records or (record(0, {}),),
        final=final or {},
    )


def test_subfedavg_takes_each_clients_last_report() -> None:
    first = {"local_accuracy.client-1": 0.5, "local_accuracy": 0.5}
    first["param_reduction.client-1"] = 0.3
    second = {"local_accuracy.client-1": 0.7, "local_accuracy.client-2": 0.9}
    second["param_reduction.client-2"] = 0.5
    records = (record(0, first), record(1, second))
    result = run_result("Sub-FedAvg (Un) 50%", "subfedavg", records)
    assert subfedavg.last_per_client(result, "local_accuracy") == {"client-1": 0.7, "client-2": 0.9}
    assert subfedavg.run_personalised(result)[0] == pytest.approx(0.8)
    assert subfedavg.run_personalised(result)[1] == 2
    assert subfedavg.reduction(SeedRuns((result,)), "param_reduction") == pytest.approx(0.4)


def test_baselines_personalised_accuracy_from_the_final_evaluation() -> None:
    final = {"local.client-0": 0.6, "own.client-0": 1.0, "local.client-1": 0.2, "own.client-1": 0.0}
    standalone = run_result(subfedavg.STANDALONE, "standalone", final=final)
    fedavg = run_result(subfedavg.FEDAVG, "fedavg", final=final)
    # Standalone: only the clients that trained a model of their own; FedAvg: every client.
    assert subfedavg.run_personalised(standalone)[0] == pytest.approx(0.6)
    assert subfedavg.run_personalised(standalone)[1] == 1
    assert subfedavg.run_personalised(fedavg)[0] == pytest.approx(0.4)
    assert subfedavg.run_personalised(fedavg)[1] == 2
    assert subfedavg.reduction(SeedRuns((fedavg,)), "param_reduction") == 0.0


def test_subfedavg_verdict_and_table_state_the_gains_in_points() -> None:
    reports = {"local_accuracy.client-0": 0.9, "param_reduction.client-0": 0.5}
    reports["flop_reduction.client-0"] = 0.45
    results = ResultSet(
        [
            run_result("Sub-FedAvg (Un) 50%", "subfedavg", (record(0, reports),)),
            run_result(subfedavg.STANDALONE, "standalone", final={"local.c": 0.85, "own.c": 1.0}),
            run_result(subfedavg.FEDAVG, "fedavg", final={"local.c": 0.5}),
        ]
    )
    lines = subfedavg.verdict(results)
    assert "+5.0 points" in lines[0] and "**well below**" in lines[0]
    assert "+40.0 points" in lines[1] and "more than the paper's" in lines[1]
    # 15 points of headroom above Standalone's 85% would allow a +20 lead: not explained by it.
    assert "**unexplained**" in lines[0]
    assert "explained" not in lines[1]
    assert "-35.0 points; agrees with the paper's remark" in lines[2]
    table = subfedavg.main_table(results)
    assert "| Sub-FedAvg (Un) 50% | 90.0 | +5.0 | +40.0 | 50.0 | 45.0 | 1 |" in table
    assert "| Standalone | 85.0 |  |  | 0.0 | 0.0 | 1 |" in table


def seeded(method: str, algorithm: str, values: list[float], seed: int) -> RunResult:
    """One seed's run whose personalised accuracy is `values[seed]`."""
    value = values[seed]
    if algorithm == "subfedavg":
        return replace(
            run_result(method, algorithm, (record(0, {"local_accuracy.c": value}),)), seed=seed
        )
    return replace(run_result(method, algorithm, final={"local.c": value, "own.c": 1.0}), seed=seed)


def test_subfedavg_gaps_are_paired_by_seed_and_judged_against_their_spread() -> None:
    sub = [0.90, 0.92, 0.94]
    steady = [0.80, 0.81, 0.82]  # gaps +10, +11, +12: mean 11, std 1
    noisy = [0.80, 1.00, 0.70]  # gaps +10, -8, +24: mean 8.7, std 16
    runs = [seeded("Sub-FedAvg (Un) 50%", "subfedavg", sub, s) for s in range(3)]
    runs += [seeded(subfedavg.STANDALONE, "standalone", steady, s) for s in range(3)]
    runs += [seeded(subfedavg.FEDAVG, "fedavg", noisy, s) for s in range(3)]
    results = ResultSet(runs)
    gain = subfedavg.gap(results, "MNIST", ["Sub-FedAvg (Un) 50%"], subfedavg.STANDALONE)
    assert gain.mean == pytest.approx(0.11)
    assert gain.std == pytest.approx(0.01)
    assert gain.count == 3
    lines = subfedavg.verdict(results)
    assert "+11.0 ± 1.0 points" in lines[0] and "**well below**" in lines[0]
    assert "within seed spread of FedAvg" in lines[1]
    # FedAvg's 83.3% leaves 16.7 points: a lead of +30 cannot occur, whatever the method.
    assert "**explained**: FedAvg's 83.3% leaves at most 16.7 points" in lines[1]
    assert "FedAvg − Standalone is +2.3 ± 15.6 points; **disagrees** with" in lines[2]
    table = subfedavg.main_table(results)
    assert "| Sub-FedAvg (Un) 50% | 92.0 ± 2.0 | +11.0 ± 1.0 | +8.7 ± 16.0 |" in table
    assert "mean ± std over 3 seeds" in table


def splitgp_final(local: float, ood: float, head: tuple[float, float]) -> dict[str, float]:
    final = {"splitgp.split_local": local, "splitgp.split_ood": ood}
    final |= {"splitgp.head_local": head[0], "splitgp.head_ood": head[1]}
    final |= {"full_local": 0.5, "full_ood": 0.5}
    for t in splitgp.SWEEP:
        # Keeping more rows local helps the local rows and hurts the others.
        final[f"splitgp.sweep.{t:g}.split_local"] = min(1.0, 0.5 + t / 4)
        final[f"splitgp.sweep.{t:g}.split_ood"] = max(0.0, 0.8 - t / 4)
    return final


def test_accuracy_at_p_mixes_local_and_ood() -> None:
    assert splitgp.mix(0.9, 0.3, 0.0) == 0.9
    assert splitgp.mix(0.9, 0.3, 1.0) == 0.3
    assert splitgp.mix(0.9, 0.3, 0.5) == pytest.approx(0.6)
    result = SeedRuns(
        (run_result(splitgp.SPLITGP, "splitgp", final=splitgp_final(0.9, 0.3, (0.95, 0.0))),)
    )
    # p = 0: 2 and 2.31 both keep the local rows right (0.5 + t / 4 capped at 1); the larger,
    # which offloads fewer rows, wins the tie.
    assert splitgp.best_threshold(result, 0.0)[0] == pytest.approx(1.0)
    assert splitgp.best_threshold(result, 0.0)[1] == 2.31
    # p = 1: threshold 0 (every row offloaded) is best on the other classes.
    assert splitgp.best_threshold(result, 1.0)[0] == pytest.approx(0.8)
    assert splitgp.best_threshold(result, 1.0)[1] == 0.0


def test_splitgp_verdict_names_where_it_is_beaten() -> None:
    def at(method: str, algorithm: str, local: float, ood: float) -> RunResult:
        return run_result(method, algorithm, final={"full_local": local, "full_ood": ood})

    results = ResultSet(
        [
            run_result(splitgp.SPLITGP, "splitgp", final=splitgp_final(0.9, 0.6, (0.95, 0.0))),
            at(splitgp.FEDAVG, "fedavg", 0.7, 0.7),
            at(splitgp.LOCAL, "standalone", 0.95, 0.0),
        ]
    )
    rows = dict(splitgp.curve_rows(results, "MNIST"))
    assert rows[splitgp.SPLITGP][0].mean == pytest.approx(0.9)
    assert rows[splitgp.FEDAVG][-1].mean == pytest.approx(0.7)
    (line,) = splitgp.verdict(results)
    # Local-only wins at p = 0 (95 vs 90) and FedAvg at p = 1 (70 vs 60): both named.
    assert "**not** best" in line
    assert "p=0 (Local-only 95.0% vs 90.0%, -5.0)" in line
    assert "p=1 (FedAvg 70.0% vs 60.0%, -10.0)" in line


def test_splitgp_verdict_tells_a_loss_within_seed_spread_from_a_real_one() -> None:
    def at(method: str, algorithm: str, local: float, ood: float, seed: int) -> RunResult:
        final = {"full_local": local, "full_ood": ood}
        return replace(run_result(method, algorithm, final=final), seed=seed)

    runs = []
    for seed, ood in enumerate((0.6, 0.8)):  # p = 1: 70 ± 14 against FedAvg's 72
        final = splitgp_final(0.9, ood, (0.95, 0.0))
        runs.append(replace(run_result(splitgp.SPLITGP, "splitgp", final=final), seed=seed))
        runs += [at(splitgp.FEDAVG, "fedavg", 0.72, 0.72, seed)]
        runs += [at(splitgp.LOCAL, "standalone", 0.95, 0.0, seed)]  # p = 0: 95 vs 90, no spread
    results = ResultSet(runs)
    rows = dict(splitgp.curve_rows(results, "MNIST"))
    assert rows[splitgp.SPLITGP][-1].std == pytest.approx(0.1414, abs=1e-4)
    (line,) = splitgp.verdict(results)
    assert "beaten at p=0 (Local-only 95.0% vs 90.0%, -5.0)" in line
    assert "within seed spread at p=1 (FedAvg 72.0% vs 70.0%, -2.0)" in line
    assert "| SplitGP | 90.0 ± 0.0 |" in splitgp.p_table(results, "MNIST")


def test_final_json_is_read_back_with_the_run(tmp_path: Path) -> None:
    run = Run("a", {"method": "A"})
    (tmp_path / "metrics.json").write_text(
        json.dumps({"run": {"status": "finished", "rounds": 0}, "records": []})
    )
    (tmp_path / EXPERIMENT_JSON).write_text(json.dumps({"wall_s": 2.0}))
    assert load_result(run, tmp_path).final == {}
    (tmp_path / FINAL_JSON).write_text(json.dumps({"full_local": 0.25, "x": float("nan")}))
    final = load_result(run, tmp_path).final
    assert final["full_local"] == 0.25 and math.isnan(final["x"])


def test_extras_follow_the_tables_and_link_their_figures(tmp_path: Path) -> None:
    def extras(results: ResultSet, slot: FigureSlot) -> list[str]:
        def draw(axes: Any, panel: str) -> bool:
            axes.plot([0, 1], [len(results), 2], label=panel)
            return True

        link = slot.figure("mine.png", "t", ["left", "right"], draw)
        assert link
        return ["**my table**", link]

    experiment = Experiment(
        name="mine",
        title="Mine",
        summary="s",
        claim="c",
        scaling="x",
        base={},
        runs=[],
        quick_runs=[],
        quick={},
        extras=extras,
    )
    out = tmp_path / "docs" / "results.md"
    write_results(experiment, ResultSet([]), Context(command="cmd", quick=True), out)
    text = out.read_text()
    assert "**my table**" in text
    assert "![mine-quick-mine](results/mine-quick-mine.png)" in text
    assert (tmp_path / "docs" / "results" / "mine-quick-mine.png").read_bytes()[:8] == PNG_MAGIC
