"""The trackers write the run directory's series, and they read back as written: TensorBoard
event files parsed record by record, the MLflow file store through MLflow's own client."""

from __future__ import annotations

import math
import struct
from pathlib import Path

import pytest
from tensorboardX.proto.event_pb2 import Event

from services.config.root import Settings
from services.report.records import VersionRecord
from services.report.tracking import (
    MLFLOW_DIR,
    TENSORBOARD_DIR,
    TrackingUnavailable,
    run_trackers,
    series,
    tracking_sinks,
)


def record(round_: int, accuracy: float) -> VersionRecord:
    return VersionRecord(
        version=round_ + 1,
        round=round_,
        elapsed_s=1.5 * round_,
        participants=4,
        global_accuracy=accuracy,
        global_loss=2.0 - accuracy,
        personal_accuracy=math.nan,  # not measured: no point logged
        train_loss=1.0,
        train_accuracy=0.5,
        samples=640,
        samples_per_s=100.0,
        bytes_up=10,
        bytes_down=20,
        extra={"level_1.accuracy": accuracy / 2},
    )


RECORDS = [record(1, 0.25), record(2, 0.5), record(3, 0.75)]


def event_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the TFRecord event files in `log_dir`: tag -> [(step, value)]."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            body = data[at + 12 : at + 12 + length]  # past length and its CRC
            at += 12 + length + 4  # and the body's CRC
            event = Event.FromString(body)
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_series_are_the_csv_columns_without_gaps() -> None:
    values = series(RECORDS[0])
    assert values["global_accuracy"] == 0.25
    assert values["extra.level_1.accuracy"] == 0.125
    assert "personal_accuracy" not in values  # NaN: not measured
    assert "round" not in values  # the axis, not a series


def test_tensorboard_events_read_back(tmp_path: Path) -> None:
    (sink,) = tracking_sinks(["tensorboard"], tmp_path, "job", {"algorithm": {"lr": 0.1}})
    for r in RECORDS:
        sink.record(r)
    sink.finish("finished")
    scalars = event_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars["global_accuracy"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [s for s, _ in scalars["extra.level_1.accuracy"]] == [1, 2, 3]
    assert scalars["samples"] == [(1, 640.0), (2, 640.0), (3, 640.0)]
    assert "personal_accuracy" not in scalars


def test_mlflow_run_reads_back(tmp_path: Path) -> None:
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    config = {"algorithm": {"name": "sfl_v2", "lr": 0.05}, "job": {"name": "demo"}}
    (sink,) = tracking_sinks(["mlflow"], tmp_path, "demo", config)
    for r in RECORDS:
        sink.record(r)
    sink.finish("failed: every model diverged")
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / MLFLOW_DIR).resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "demo"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["algorithm.lr"] == "0.05"
    assert run.info.status == "FAILED"
    assert run.data.tags["splitmq.status"] == "failed: every model diverged"
    history = client.get_metric_history(run.info.run_id, "global_accuracy")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    assert [m.timestamp for m in history] == [1500, 3000, 4500]  # elapsed_s, in ms


def test_trackers_are_off_by_default_and_chosen_in_config(tmp_path: Path) -> None:
    assert run_trackers(Settings(), tmp_path) == []
    chosen = Settings.model_validate({"report": {"tracking": ["tensorboard"]}})
    (sink,) = run_trackers(chosen, tmp_path)
    sink.finish("finished")
    assert list((tmp_path / TENSORBOARD_DIR).glob("events.out.tfevents.*"))


def test_unknown_tracker_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="tracking"):
        Settings.model_validate({"report": {"tracking": ["wandb"]}})


def test_missing_library_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # import fails as if not installed
    with pytest.raises(TrackingUnavailable, match=r"splitmq\[tracking\]"):
        tracking_sinks(["tensorboard"], tmp_path, "job", {})


def test_the_run_report_feeds_the_chosen_trackers(tmp_path: Path) -> None:
    """`splitmq run`, `up`'s aggregator and `experiment` build their sinks here."""
    from services.cli.common import run_report

    settings = Settings.model_validate(
        {"job": {"name": "tracked"}, "report": {"tracking": ["tensorboard"], "plots": False}}
    )
    files, sink = run_report(settings, tmp_path)
    for r in RECORDS:
        sink.record(r)
    sink.finish("finished")
    scalars = event_scalars(files.run_dir / TENSORBOARD_DIR)
    assert [v for _, v in scalars["global_accuracy"]] == [0.25, 0.5, 0.75]


def test_a_resumed_run_goes_on_in_its_trackers(tmp_path: Path) -> None:
    """`--resume`: TensorBoard's and MLflow's series run from round 1, not from the resume."""
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    config = {"job": {"name": "demo", "rounds": 2}}
    first = tracking_sinks(["tensorboard", "mlflow"], tmp_path, "demo", config)
    for sink in first:
        for r in RECORDS[:2]:
            sink.record(r)
        sink.finish("stopped")
    # The resume asks for one more round: a changed parameter MLflow would refuse to log.
    again = {"job": {"name": "demo", "rounds": 3}}
    second = tracking_sinks(["tensorboard", "mlflow"], tmp_path, "demo", again, resume=True)
    for sink in second:
        sink.record(RECORDS[2])
        sink.finish("finished")
    scalars = event_scalars(tmp_path / TENSORBOARD_DIR)
    assert scalars["global_accuracy"] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / MLFLOW_DIR).resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "demo"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["job.rounds"] == "2"  # as first logged
    history = client.get_metric_history(run.info.run_id, "global_accuracy")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5), (3, 0.75)]


def test_a_resume_without_an_earlier_mlflow_run_starts_one(tmp_path: Path) -> None:
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    (sink,) = tracking_sinks(["mlflow"], tmp_path, "demo", {"job": {"name": "demo"}}, resume=True)
    sink.record(RECORDS[0])
    sink.finish("finished")
    client = mlflow_tracking.MlflowClient(tracking_uri=(tmp_path / MLFLOW_DIR).resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "demo"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["job.name"] == "demo"
