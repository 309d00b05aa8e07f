"""The run directory: metrics JSON/CSV, plots, summary and config, on synthetic records."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import tomllib
from dataclasses import replace as dataclasses_replace
from datetime import datetime
from pathlib import Path

import pytest

from services.config.root import Settings
from services.report.filesink import FileSink
from services.report.records import VersionRecord
from services.report.rundir import RunInfo, create_run_dir, source_commit
from services.report.sinks import EchoSink, TeeSink
from services.report.summary import Totals, progress_line, summary_text
from services.report.tables import record_from_dict
from services.report.tomlwrite import dumps, redact, redact_url

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_record(version: int, *, acc: float, personal: float = math.nan) -> VersionRecord:
    rnd = version - 1
    return VersionRecord(
        version=version,
        round=rnd,
        elapsed_s=10.0 * rnd,
        participants=4,
        global_accuracy=acc,
        global_loss=2.0 - acc,
        personal_accuracy=personal,
        train_loss=1.5 / rnd,
        train_accuracy=acc - 0.05,
        samples=1000 * rnd,
        samples_per_s=100.0 * rnd,
        bytes_up=1_000_000 * rnd,
        bytes_down=2_000_000 * rnd,
        late_updates=rnd % 2,
        extra={"staleness_max": float(rnd)} if rnd % 2 else {},
    )


def settings_in(tmp_path: Path, **report: object) -> Settings:
    return Settings.model_validate(
        {
            "job": {"name": "demo", "rounds": 3},
            "report": {"dir": str(tmp_path / "runs"), **report},
            "broker": {"amqp_url": "amqp://alice:s3cret@mq.example:5672/%2F"},
        }
    )


RECORDS = [
    make_record(2, acc=0.50, personal=0.55),
    make_record(3, acc=0.72, personal=0.70),
    make_record(4, acc=0.68, personal=0.81),
]


def test_metrics_files_follow_each_record_before_finish(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path), command="splitmq run x.toml")
    assert sink.run_dir.parent == tmp_path / "runs"
    assert sink.run_dir.name.startswith("demo-")
    for n, record in enumerate(RECORDS[:2], start=1):
        sink.record(record)
        doc = json.loads((sink.run_dir / "metrics.json").read_text())
        # A run killed now still has every version it published on disk.
        assert [r["version"] for r in doc["records"]] == [r.version for r in RECORDS[:n]]
        assert doc["run"]["status"] == "running"
    assert not (sink.run_dir / "summary.txt").exists()


def test_finish_writes_json_csv_plots_and_summary(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path), command="splitmq run x.toml")
    for record in RECORDS:
        sink.record(record)
    sink.finish("finished")
    run_dir = sink.run_dir

    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    assert doc["run"]["job"] == "demo"
    assert doc["run"]["command"] == "splitmq run x.toml"
    assert doc["run"]["ended_at"] and doc["run"]["torch"] and doc["run"]["host"]
    assert [record_from_dict(r) for r in doc["records"]] == RECORDS

    with (run_dir / "metrics.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["version"]) for r in rows] == [2, 3, 4]
    assert float(rows[1]["global_accuracy"]) == pytest.approx(0.72)
    assert rows[0]["extra.staleness_max"] == "1.0" and rows[1]["extra.staleness_max"] == ""

    for name in ("accuracy.png", "throughput.png", "loss.png"):
        data = (run_dir / name).read_bytes()
        assert data.startswith(PNG_MAGIC), name
        assert len(data) > 5_000, f"{name} is suspiciously small ({len(data)} bytes)"

    summary = (run_dir / "summary.txt").read_text()
    assert summary == sink.summary
    assert "final global accuracy    68.0%   (best 72.0% in round 2)" in summary
    assert "final personal accuracy  81.0%" in summary
    assert "samples/s (median)       200" in summary
    assert "bytes up / down          5.7 MiB / 11.4 MiB" in summary
    assert str(run_dir) in summary


def test_finish_counts_once(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path), command="c")
    sink.finish("finished")
    sink.finish("failed: too late")
    doc = json.loads((sink.run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    assert "no version was published" in sink.summary
    assert not (sink.run_dir / "accuracy.png").exists()


def test_nan_metrics_become_null_and_are_not_plotted(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path), command="c")
    sink.record(make_record(2, acc=0.4))
    sink.record(make_record(3, acc=0.6))
    sink.finish("finished")
    text = (sink.run_dir / "metrics.json").read_text()
    assert "NaN" not in text
    assert json.loads(text)["records"][0]["personal_accuracy"] is None
    assert "final personal accuracy  n/a   (best n/a)" in sink.summary
    assert (sink.run_dir / "accuracy.png").read_bytes().startswith(PNG_MAGIC)


def test_plots_can_be_turned_off(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path, plots=False), command="c")
    sink.record(RECORDS[0])
    sink.finish("finished")
    assert not list(sink.run_dir.glob("*.png"))


def test_config_is_the_effective_settings_with_secrets_masked(tmp_path: Path) -> None:
    settings = settings_in(tmp_path)
    sink = FileSink.create(settings, command="c")
    text = (sink.run_dir / "config.toml").read_text()
    assert "s3cret" not in text
    data = tomllib.loads(text)
    assert data["broker"]["amqp_url"] == "amqp://alice:***@mq.example:5672/%2F"
    data["broker"]["amqp_url"] = settings.broker.amqp_url
    assert Settings.model_validate(data) == settings


def test_same_second_runs_get_separate_directories(tmp_path: Path) -> None:
    at = datetime(2025, 1, 2, 3, 4, 5)
    first = create_run_dir(tmp_path, "job", at)
    second = create_run_dir(tmp_path, "job", at)
    assert first.name == "job-20250102-030405"
    assert second.name == "job-20250102-030405-2"


def test_long_runs_are_shortened_to_one_screen() -> None:
    records = [make_record(v, acc=v / 100) for v in range(2, 40)]
    info = RunInfo.for_settings(Settings(), "c", datetime.now())
    text = summary_text(info, records)
    assert len(text.splitlines()) < 25
    assert "  ..." in text
    assert "39%" not in text.splitlines()[3]  # the first rows are the early rounds
    totals = Totals.of(records)
    # Version 39 closed round 38 (make_record's rounds: version - 1, counted from 1).
    assert totals is not None and totals.best_global_round == 38


def test_progress_line_and_sinks_compose() -> None:
    lines: list[str] = []
    statuses: list[str] = []

    class Recorder:
        def record(self, record: VersionRecord) -> None:
            lines.append(f"rec {record.version}")

        def finish(self, status: str) -> None:
            statuses.append(status)

    tee = TeeSink([Recorder(), EchoSink(lines.append, rounds=3)])
    tee.record(RECORDS[1])
    tee.finish("finished")
    tee.finish("stopped")
    assert lines[0] == "rec 3"
    assert lines[1] == progress_line(RECORDS[1], 3)
    assert lines[1].startswith("round 2/3  v3  global  72.0%  personal  70.0%")
    assert "200 samples/s" in lines[1]
    assert lines[2:] == ["job finished"]  # said once, though every sink saw both
    assert statuses == ["finished", "stopped"]


def test_redaction_masks_passwords_and_secret_keys() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("amqp://guest@h") == "amqp://guest@h"
    assert redact_url("not a url") == "not a url"
    out = redact({"a": {"password": "x", "url": "amqps://u:p@h/"}, "n": 3})
    assert out == {"a": {"password": "***", "url": "amqps://u:***@h/"}, "n": 3}


def test_own_toml_writer_round_trips_awkward_values() -> None:
    data = {
        "title": 'quote " back\\slash\nnew line\ttab é \x7f',
        "flag": False,
        "n": -3,
        "x": 0.1,
        "big": 1e300,
        "inf": math.inf,
        "list": [1, 2, 3],
        "strs": ["a", "b"],
        "skip": None,
        "section": {"dotted.key": 1, "inner": {"deep": "yes"}, "empty": {}},
    }
    parsed = tomllib.loads(dumps(data))
    expected = {k: v for k, v in data.items() if k != "skip"}
    assert parsed == expected


def test_plots_in_vector_formats_too(tmp_path: Path) -> None:
    sink = FileSink.create(settings_in(tmp_path, plot_formats=["png", "pdf", "svg"]), command="c")
    for record in RECORDS:
        sink.record(record)
    sink.finish("finished")
    for stem in ("accuracy", "loss", "progress"):
        assert (sink.run_dir / f"{stem}.png").read_bytes().startswith(PNG_MAGIC)
        assert (sink.run_dir / f"{stem}.pdf").read_bytes().startswith(b"%PDF")
        assert b"<svg" in (sink.run_dir / f"{stem}.svg").read_bytes()[:2000]


def test_progress_plots_accuracy_against_four_axes(tmp_path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from services.report.plots import _AXES, _progress

    figure = Figure()
    FigureCanvasAgg(figure)
    draw = _progress(RECORDS)
    xs = {}
    for name, label, _ in _AXES:
        axes = figure.add_subplot()
        assert draw(axes, name)
        assert axes.get_xlabel() == label
        xs[name] = list(axes.lines[0].get_xdata())
        figure.delaxes(axes)
    assert xs["round"] == [1, 2, 3]
    assert xs["wall-clock"] == [10.0, 20.0, 30.0]
    assert xs["samples"] == [1000, 3000, 6000]  # cumulative
    assert xs["bytes"] == pytest.approx([3e6 / 2**20, 9e6 / 2**20, 18e6 / 2**20])


def test_an_algorithm_draws_its_own_series(tmp_path: Path) -> None:
    """SplitGP's split-inference metrics reach algorithm.png; SFL has none, so no figure."""
    from services.algorithms.splitgp import SplitGP
    from services.report.plots import PlotSpec, _algorithm_series, write_plots

    extra = {"splitgp.split_local": 0.8, "splitgp.split_ood": 0.4, "splitgp.head_local": 0.7}
    records = [dataclasses_replace(r, extra=extra) for r in RECORDS]
    made = write_plots(tmp_path, records, algorithm_plots=SplitGP.traits.report_plots)
    assert tmp_path / "algorithm.png" in made
    assert (tmp_path / "algorithm.png").read_bytes().startswith(PNG_MAGIC)
    from matplotlib.figure import Figure

    axes = Figure().add_subplot()
    assert _algorithm_series(records, SplitGP.traits.report_plots["split inference accuracy"])(
        axes, ""
    )
    assert sorted(line.get_label() for line in axes.lines) == [
        "splitgp.split_local",
        "splitgp.split_ood",
    ]
    other = tmp_path / "sfl"
    write_plots(other, records, algorithm_plots=PlotSpec().algorithm)
    assert not (other / "algorithm.png").exists()


def test_metrics_json_names_the_code_that_ran(tmp_path: Path) -> None:
    import subprocess

    sink = FileSink.create(settings_in(tmp_path), command="c")
    run = json.loads((sink.run_dir / "metrics.json").read_text())["run"]
    assert run["splitmq"]  # the installed package's version
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
    ).stdout.strip()
    if head:  # tests run from a checkout: its commit, marked when the tree has changes
        assert run["git_commit"].removesuffix("+dirty") == head


def test_the_source_commit_is_the_one_the_process_started_with(tmp_path: Path) -> None:
    """A run records the commit its code came from: a commit made in the tree while a long
    grid runs does not relabel the grid's later runs."""

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    git("init", "-q")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "code.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "first")
    first = git("rev-parse", "HEAD")
    assert source_commit(tmp_path) == first
    (tmp_path / "code.py").write_text("x = 2\n")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "second")
    assert source_commit(tmp_path) == first
