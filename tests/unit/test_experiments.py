"""The experiments harness without training: tag matching, tables, sections, settings, budget."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from services.client.data import JobData
from services.config.root import Settings
from services.data.loaders import Dataset, Split
from services.data.registry import get_spec
from services.experiments import fedsplitx, minibatch_sfl, subfedavg
from services.experiments.centralized import (
    client_steps,
    steps_per_round,
    train_centralized,
    union_batches,
)
from services.experiments.document import write_section
from services.experiments.registry import NAMES, get_experiment
from services.experiments.results import ResultSet, RunResult, matches, settled_status
from services.experiments.runner import build_settings, comparable, same_settings, slug
from services.experiments.spec import EXAMPLES_DIR, Run, Table
from services.experiments.tables import render_table
from services.report.records import ListSink, VersionRecord


def record(round_index: int, accuracy: float) -> VersionRecord:
    return VersionRecord(
        version=round_index + 2,
        round=round_index + 1,  # records count rounds from 1
        elapsed_s=float(round_index + 1),
        participants=1,
        global_accuracy=accuracy,
        global_loss=1.0,
        personal_accuracy=math.nan,
        train_loss=1.0,
        train_accuracy=0.5,
        samples=10,
        samples_per_s=10.0,
        bytes_up=0,
        bytes_down=0,
    )


def result(label: str, tags: dict[str, str], accuracies: list[float]) -> RunResult:
    return RunResult(
        run=Run(label, tags),
        run_dir=Path("/nowhere"),
        status="finished",
        wall_s=1.0,
        rounds=len(accuracies),
        records=tuple(record(i, a) for i, a in enumerate(accuracies)),
    )


@pytest.fixture
def results() -> ResultSet:
    return ResultSet(
        [
            result("a1", {"algorithm": "A", "cut": "c1"}, [0.5, 0.70]),
            result("b1", {"algorithm": "B", "cut": "c1"}, [0.5, 0.60]),
            result("a2", {"algorithm": "A", "cut": "c2"}, [0.5, 0.80]),
            result("b2", {"algorithm": "B", "cut": "c2"}, [0.9, 0.65]),
            # A baseline that does not depend on the cut: one run for every row.
            result("base", {"algorithm": "F"}, [0.4, 0.55]),
        ]
    )


def test_a_missing_tag_matches_any_value() -> None:
    assert matches({"algorithm": "F"}, {"algorithm": "F", "cut": "c2"})
    assert not matches({"algorithm": "F"}, {"algorithm": "A"})
    assert not matches({"algorithm": "A", "cut": "c1"}, {"cut": "c2"})


def test_lookup_prefers_the_run_naming_the_tag(results: ResultSet) -> None:
    extra = ResultSet([*results, result("b2-own", {"algorithm": "F", "cut": "c2"}, [0.1])])
    found = extra.one({"algorithm": "F", "cut": "c2"})
    assert found is not None and found.label == "b2-own"
    found = extra.one({"algorithm": "F", "cut": "c1"})
    assert found is not None and found.label == "base"


def test_final_and_best_metrics(results: ResultSet) -> None:
    assert results.value("final_global", algorithm="B", cut="c2") == pytest.approx(0.65)
    assert results.value("best_global", algorithm="B", cut="c2") == pytest.approx(0.9)
    assert math.isnan(results.value("final_global", algorithm="Z"))


def test_table_cells_diffs_and_baseline_rows(results: ResultSet) -> None:
    table = Table("T", rows=("cut",), column="algorithm", diffs=(("A", "B"), ("A", "F")))
    text = render_table(table, results)
    lines = text.splitlines()
    assert lines[2] == "| cut | A | B | F | A − B | A − F |"
    assert lines[4] == "| c1 | 70.0 | 60.0 | 55.0 | +10.0 | +15.0 |"
    assert lines[5] == "| c2 | 80.0 | 65.0 | 55.0 | +15.0 | +25.0 |"


def test_write_section_replaces_only_its_own_section(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    write_section("one", "first", path)
    write_section("two", "second", path)
    write_section("one", "first, again", path)
    text = path.read_text()
    assert text.startswith("# Results")
    assert "<!-- one -->\nfirst, again\n<!-- /one -->" in text
    assert "<!-- two -->\nsecond\n<!-- /two -->" in text
    assert "first\n" not in text.replace("first, again", "")
    assert text.index("<!-- one -->") < text.index("<!-- two -->")


def test_write_section_refuses_an_unclosed_marker(tmp_path: Path) -> None:
    path = tmp_path / "results.md"
    path.write_text("# Results\n\n<!-- one -->\nhalf\n")
    with pytest.raises(ValueError, match="no closing"):
        write_section("one", "x", path)


def test_every_registered_experiment_builds_valid_settings() -> None:
    for name in NAMES:
        experiment = get_experiment(name)
        labels = [r.label for r in experiment.runs]
        assert len(set(labels)) == len(labels), "labels name run directories: must be unique"
        for quick in (False, True):
            for run in experiment.grid(quick):
                settings = build_settings(experiment, run, quick=quick, data_dir="/data")
                assert settings.data.dir == "/data"
                assert settings.job.name == slug(run.label)


def test_every_paper_setting_builds_valid_settings_of_its_own_section() -> None:
    with_paper = 0
    for name in NAMES:
        experiment = get_experiment(name)
        if experiment.paper_base is None:
            with pytest.raises(FileNotFoundError, match="no paper setting"):
                experiment.at_paper()
            continue
        with_paper += 1
        paper = experiment.at_paper()
        assert paper.name == f"{name}-paper"
        assert paper.base == experiment.paper_base
        assert paper.paper_base is None
        labels = [r.label for r in paper.runs]
        assert len(set(labels)) == len(labels)
        for run in paper.runs:
            settings = build_settings(paper, run, quick=False, data_dir="/data")
            assert settings.job.name == slug(run.label)
    # The toml files are loaded by name: a renamed one must not silently drop its setting.
    shipped = {p.name.removesuffix("-paper.toml") for p in EXAMPLES_DIR.glob("*-paper.toml")}
    assert with_paper == len(shipped & set(NAMES))


def test_paper_and_quick_exclude_each_other() -> None:
    from click.testing import CliRunner

    from services.cli.experiment_cmd import experiment

    outcome = CliRunner().invoke(experiment, ["subfedavg", "--paper", "--quick"])
    assert outcome.exit_code == 2
    assert "exclude each other" in outcome.output


def test_the_words_state_the_papers_numbers_the_verdicts_use() -> None:
    # The claims live in examples/experiments/<name>.md; the verdicts compare with these.
    claim = minibatch_sfl.build().claim
    assert f"{minibatch_sfl.PAPER_GAIN_OVER_SFL}% and\n{minibatch_sfl.PAPER_GAIN_OVER_FL}%" in claim
    claim = subfedavg.build().claim
    assert f"about {subfedavg.PAPER_OVER_STANDALONE:.0f} points above" in claim
    assert f"about {subfedavg.PAPER_OVER_FEDAVG:.0f} points above FedAvg" in claim
    assert fedsplitx.PAPER in fedsplitx.build().claim


def test_minibatch_sfl_grid_is_the_issue_grid() -> None:
    experiment = minibatch_sfl.build()
    runs = experiment.runs
    split = {(r.tags["algorithm"], r.tags["r"], r.tags["cut"]) for r in runs if "cut" in r.tags}
    assert len(split) == 2 * 3 * 3
    for run in runs:
        s = build_settings(experiment, run, quick=False, data_dir=None)
        assert (s.data.dataset, s.clients.count, s.data.partition) == (
            "fashion_mnist",
            10,
            "label_ratio",
        )
        if "r" in run.tags:
            assert s.data.ratio == float(run.tags["r"])
        if "cut" in run.tags:
            assert s.model.cut == run.tags["cut"]
            assert s.algorithm.name in ("minibatch_sfl", "sfl_v2")
    fedavg = [r for r in runs if r.tags["algorithm"] == "FedAvg"]
    assert [r.tags["r"] for r in fedavg] == ["0", "0.8", "0.95"]
    assert [r.kind for r in runs].count("centralized") == 1


def test_quick_shrinks_the_rounds_and_steps() -> None:
    experiment = minibatch_sfl.build()
    run = experiment.quick_runs[0]
    full = build_settings(experiment, run, quick=False, data_dir=None)
    quick = build_settings(experiment, run, quick=True, data_dir=None)
    assert quick.job.rounds < full.job.rounds
    assert quick.algorithm.max_steps_per_round < full.algorithm.max_steps_per_round


def test_reuse_ignores_where_the_data_lives() -> None:
    experiment = minibatch_sfl.build()
    run = experiment.runs[0]
    a = build_settings(experiment, run, quick=False, data_dir="/one")
    b = build_settings(experiment, run, quick=False, data_dir="/two")
    c = build_settings(experiment, experiment.runs[1], quick=False, data_dir="/one")
    assert comparable(a) == comparable(b)
    assert comparable(a) != comparable(c)


def test_reuse_accepts_settings_added_since_at_their_default() -> None:
    defaults = {"a": {"x": 1, "new": 0}, "b": 2}
    stored = {"a": {"x": 5}, "b": 2}
    assert same_settings(stored, {"a": {"x": 5, "new": 0}, "b": 2}, defaults)
    assert not same_settings(stored, {"a": {"x": 5, "new": 1}, "b": 2}, defaults)
    assert not same_settings(stored, {"a": {"x": 6, "new": 0}, "b": 2}, defaults)
    assert not same_settings({**stored, "gone": 1}, {"a": {"x": 5, "new": 0}, "b": 2}, defaults)


def tiny_dataset(n_train: int = 120, n_test: int = 40) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    y = torch.arange(n_train) % 10
    # Each class lights up its own pixel block: learnable in a few steps.
    x = torch.randn(n_train, 1, 28, 28, generator=generator) * 0.1
    for c in range(10):
        x[y == c, :, 2 * c : 2 * c + 3, :] += 2.0
    yt = torch.arange(n_test) % 10
    xt = torch.randn(n_test, 1, 28, 28, generator=generator) * 0.1
    for c in range(10):
        xt[yt == c, :, 2 * c : 2 * c + 3, :] += 2.0
    return Dataset(get_spec("fashion_mnist").info, Path("."), Split(x, y), Split(xt, yt))


def centralized_settings(**algorithm: object) -> Settings:
    return Settings.model_validate(
        {
            "job": {"rounds": 3, "seed": 0},
            "data": {"dataset": "fashion_mnist", "partition": "label_ratio", "ratio": 0.9},
            "algorithm": {"name": "fedavg", "batch_size": 8, "lr": 0.05, **algorithm},
            "clients": {"count": 4, "fraction": 0.5, "min_to_start": 1},
        }
    )


def test_centralized_budget_is_a_cohorts_worth_of_local_steps() -> None:
    dataset = tiny_dataset()
    settings = centralized_settings(max_steps_per_round=3)
    data = JobData(settings, dataset)
    # 120 samples / 4 clients = 30 each = 4 batches of 8, capped at 3 steps.
    assert client_steps(data, settings) == [3, 3, 3, 3]
    assert steps_per_round(data, settings) == 6  # half of the clients per round
    uncapped = centralized_settings(local_epochs=2)
    assert steps_per_round(JobData(uncapped, dataset), uncapped) == 16
    union = union_batches(data, settings)
    assert sorted(np.asarray(union.indices).tolist()) == list(range(120))


def test_centralized_trains_and_records_each_round() -> None:
    dataset = tiny_dataset()
    settings = centralized_settings(max_steps_per_round=5)
    sink = ListSink()
    status = train_centralized(settings, dataset, sink, threading.Event())
    assert status == "finished" and sink.status == "finished"
    assert [r.round for r in sink.records] == [1, 2, 3]
    # Each client has 4 batches (30 samples), under the cap of 5: 2 clients x 4 steps x 8.
    assert all(r.samples == 2 * 4 * 8 for r in sink.records)
    assert sink.records[-1].global_accuracy > 0.5  # chance is 0.1


def test_centralized_stops_when_asked() -> None:
    stop = threading.Event()
    stop.set()
    sink = ListSink()
    assert train_centralized(centralized_settings(), tiny_dataset(), sink, stop) == "stopped"
    assert sink.records == [] and sink.status == "stopped"


def test_an_archived_run_is_reused_when_its_report_directory_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.experiments import runner
    from services.experiments.experiment import Experiment

    monkeypatch.setattr(runner, "load_dataset", lambda name, where: tiny_dataset())
    base = centralized_settings(max_steps_per_round=2).model_dump(mode="json")
    base["job"]["rounds"] = 1
    run = Run("one", {"algorithm": "Centralized"}, {}, kind="centralized")
    spec = Experiment("tiny", "t", "", "", "", base, [run], [], {})
    said: list[str] = []
    first = runner.run_experiment(spec, runs_dir=tmp_path / "a", archive=tmp_path / "kept")
    assert first.runs[0].complete
    assert sorted(p.name for p in (tmp_path / "kept" / "tiny" / "one").iterdir()) == sorted(
        n for n in runner.ARCHIVED if (tmp_path / "a" / "tiny" / "one" / n).exists()
    )
    again = runner.run_experiment(
        spec, runs_dir=tmp_path / "b", archive=tmp_path / "kept", reuse=True, echo=said.append
    )
    assert again.runs[0].reused and "kept" in said[0]
    assert again.runs[0].records == first.runs[0].records
    # A changed setting is a different run: trained, not read back.
    changed = Experiment("tiny", "t", "", "", "", base | {"job": {"rounds": 2}}, [run], [], {})
    fresh = runner.run_experiment(
        changed, runs_dir=tmp_path / "b", archive=tmp_path / "kept", reuse=True, echo=said.append
    )
    assert not fresh.runs[0].reused and len(fresh.runs[0].records) == 2


def test_the_stated_command_names_only_the_flags_given() -> None:
    from services.cli.experiment_cmd import _command, experiment

    given = experiment.make_context("experiment", ["splitgp", "--paper", "--seeds", "3"])
    assert _command(given) == "splitmq experiment splitgp --paper --seeds 3"
    plain = experiment.make_context("experiment", ["splitgp", "--reuse"])
    assert _command(plain) == "splitmq experiment splitgp"


def test_a_run_that_failed_by_itself_is_settled_and_a_stopped_one_is_not() -> None:
    # A diverged model fails the same way again: its outcome is kept and reused. A run
    # stopped from outside (Ctrl-C, a timeout) says nothing about its settings.
    assert settled_status("finished", 5, 5)
    assert not settled_status("finished", 4, 5)
    assert settled_status(
        "failed: 3 consecutive attempts at round 27 without one valid update", 26, 30
    )
    assert not settled_status("stopped", 26, 30)
