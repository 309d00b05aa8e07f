"""Experiments over several seeds: each label's runs read as one result (means), tables show
mean ± std, figures a band, and the runner gives every seed its own job.seed and directory."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path

import pytest

from services.experiments.document import Context, render_section, seeds_line
from services.experiments.figures import FigureSlot, write_figure
from services.experiments.registry import get_experiment
from services.experiments.results import ResultSet, RunResult, SeedRuns, Spread
from services.experiments.runner import seeded
from services.experiments.spec import CurvePlot, FinalPlot, Run, Table
from services.experiments.tables import render_table, runs_table
from tests.unit.test_experiments import record


def seed_run(label: str, tags: dict[str, str], seed: int, accuracies: list[float]) -> RunResult:
    records = tuple(
        dataclasses.replace(record(i, a), samples=10 + seed, extra={"x": float(seed)})
        for i, a in enumerate(accuracies)
    )
    return RunResult(
        run=Run(label, tags),
        run_dir=Path(f"/nowhere/{label}-{seed}"),
        status="finished",
        wall_s=2.0,
        rounds=len(accuracies),
        records=records,
        seed=seed,
    )


@pytest.fixture
def seeded_results() -> ResultSet:
    return ResultSet(
        [
            seed_run("a", {"algorithm": "A"}, 0, [0.5, 0.70]),
            seed_run("a", {"algorithm": "A"}, 1, [0.4, 0.74]),
            seed_run("a", {"algorithm": "A"}, 2, [0.6, 0.78]),
            seed_run("b", {"algorithm": "B"}, 0, [0.5, 0.60]),
            seed_run("b", {"algorithm": "B"}, 1, [0.3, 0.62]),
            seed_run("b", {"algorithm": "B"}, 2, [0.2, 0.64]),
        ]
    )


def test_a_label_over_seeds_reads_as_its_mean(seeded_results: ResultSet) -> None:
    assert len(seeded_results) == 2 and len(seeded_results.runs) == 6
    assert seeded_results.seeds == 3
    a = seeded_results.one({"algorithm": "A"})
    assert a is not None and a.seeds == (0, 1, 2)
    finals = [0.70, 0.74, 0.78]
    spread = a.spread("final_global")
    assert spread.mean == pytest.approx(statistics.mean(finals))
    assert spread.std == pytest.approx(statistics.stdev(finals))
    assert spread.count == 3
    # best is taken per seed, then averaged (not the best of the mean curve)
    assert a.metric("best_global") == pytest.approx(statistics.mean([0.70, 0.74, 0.78]))
    assert a.curve() == pytest.approx([0.5, 0.74])
    # the records verdicts read are the seeds' means, counts rounded, extras averaged
    assert [r.global_accuracy for r in a.records] == pytest.approx([0.5, 0.74])
    assert a.records[0].samples == 11 and a.records[0].extra["x"] == pytest.approx(1.0)
    assert a.wall_s == pytest.approx(6.0) and a.complete


def test_one_seed_is_the_run_itself() -> None:
    only = seed_run("a", {}, 0, [0.5, 0.7])
    group = SeedRuns((only,))
    assert group.records is only.records
    assert group.spread("final_global") == Spread(0.7, 0.0, 1)


def test_an_unfinished_seed_makes_the_label_unfinished(seeded_results: ResultSet) -> None:
    failed = dataclasses.replace(seeded_results.runs[1], status="failed: diverged")
    results = ResultSet([seeded_results.runs[0], failed, seeded_results.runs[2]])
    (a,) = results
    assert a.status == "failed: diverged" and not a.complete


def test_table_cells_carry_mean_and_std(seeded_results: ResultSet) -> None:
    text = render_table(
        Table("T", rows=(), column="algorithm", diffs=(("A", "B"),)), seeded_results
    )
    assert "mean ± std over 3 seeds" in text.splitlines()[0]
    row = text.splitlines()[-1]
    a_std = 100 * statistics.stdev([0.70, 0.74, 0.78])
    assert row == f"| 74.0 ± {a_std:.1f} | 62.0 ± 2.0 | +12.0 |"


def test_runs_table_lists_every_seed(seeded_results: ResultSet) -> None:
    lines = runs_table(seeded_results.runs).splitlines()
    assert "| seed |" in lines[0]
    assert len(lines) == 2 + 6
    assert lines[3].startswith("| `a` | A | 1 | finished |")


def test_figures_draw_a_band_and_error_bars(seeded_results: ResultSet, tmp_path: Path) -> None:
    slot = FigureSlot(tmp_path, "x-", tmp_path)
    curve = write_figure(CurvePlot("curve.png", "c", lines="algorithm"), seeded_results, slot)
    final = write_figure(
        FinalPlot("final.png", "f", x="algorithm", lines="algorithm"), seeded_results, slot
    )
    assert curve and final
    assert (tmp_path / "x-curve.png").stat().st_size > 0
    assert (tmp_path / "x-final.png").stat().st_size > 0


def test_the_section_says_how_many_seeds(seeded_results: ResultSet) -> None:
    assert seeds_line(seeded_results).startswith("3 per configuration (job.seed 0, 1, 2")
    assert seeds_line(ResultSet([seeded_results.runs[0]])).startswith("one per configuration")
    experiment = get_experiment("minibatch_sfl")
    text = render_section(experiment, seeded_results, Context("cmd", quick=True), [])
    assert "**Seeds.** 3 per configuration" in text
    assert "for 6 runs" in text


def test_each_seed_has_its_own_job_seed_and_directory() -> None:
    experiment = get_experiment("minibatch_sfl")
    run = experiment.grid(quick=True)[0]
    plans = seeded(experiment, run, 3, quick=True, data_dir=None)
    base = plans[0][0].job.seed
    assert [s.job.seed for s, _ in plans] == [base, base + 1, base + 2]
    names = [d for _, d in plans]
    assert names[1:] == [f"{names[0]}-seed{base + 1}", f"{names[0]}-seed{base + 2}"]
    # otherwise the very same job
    first, second = plans[0][0], plans[1][0]
    assert first.algorithm == second.algorithm and first.model == second.model
