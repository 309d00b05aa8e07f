"""Experiment trackers as MetricsSinks: TensorBoard event files and MLflow.

`[report] tracking = ["tensorboard", "mlflow"]` adds them beside the run directory's own
files. TensorBoard's events go to `<run_dir>/tensorboard/`; MLflow's run to a file store in
`<run_dir>/mlruns/`, unless `[report] mlflow_uri` names another store. They log the very series
metrics.csv has: every numeric column of a VersionRecord and its `extra` metrics, one point per
published version, stepped by the record's round. Their libraries are optional
(`pip install 'splitmq[tracking]'`) and imported only when a tracker is chosen.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

from services.config.root import Settings
from services.report.records import MetricsSink, VersionRecord
from services.report.tomlwrite import flatten, redact

TRACKERS = ("tensorboard", "mlflow")
TENSORBOARD_DIR = "tensorboard"
MLFLOW_DIR = "mlruns"

# Record fields that are the series' axis or say nothing as a scalar.
_NOT_SERIES = frozenset({"round", "extra"})
# MLflow refuses a parameter value longer than this (its `MAX_PARAM_VAL_LENGTH`).
_MLFLOW_PARAM_CHARS = 6000


class TrackingUnavailable(RuntimeError):
    """A tracker was chosen but its library is not installed."""


def series(record: VersionRecord) -> dict[str, float]:
    """The record's scalars by name, as metrics.csv names its columns (`extra.<name>`); NaN
    (not measured this round) is left out, as trackers plot it as a gap anyway."""
    row = asdict(record)
    out = {k: float(v) for k, v in row.items() if k not in _NOT_SERIES}
    out.update({f"extra.{k}": float(v) for k, v in record.extra.items()})
    return {k: v for k, v in out.items() if math.isfinite(v)}


def _library(module: str, tracker: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackingUnavailable(
            f"report.tracking = [{tracker!r}] needs {module.split('.')[0]}: "
            "pip install 'splitmq[tracking]' (or remove it from report.tracking)"
        ) from None


class _Writer(Protocol):
    def add_scalar(self, tag: str, value: float, global_step: int) -> None: ...
    def add_text(self, tag: str, text: str, global_step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars per record into `<run_dir>/tensorboard/` (tensorboardX's event files, which
    TensorBoard reads: `tensorboard --logdir runs/`)."""

    def __init__(self, run_dir: Path, params: Mapping[str, str]) -> None:
        tbx = _library("tensorboardX", "tensorboard")
        self.log_dir = run_dir / TENSORBOARD_DIR
        # A resumed run adds its own event file beside the earlier ones (TensorBoard reads a
        # directory's files as one series); the suffix keeps it from taking an earlier one's
        # name, which is made of the time in seconds, the host and the process id.
        earlier = len(list(self.log_dir.glob("events.out.tfevents.*")))
        suffix = f".{earlier}" if earlier else ""
        self._writer: _Writer = tbx.SummaryWriter(logdir=str(self.log_dir), filename_suffix=suffix)
        table = "\n".join(f"| {k} | {v} |" for k, v in sorted(params.items()))
        self._writer.add_text("config", "| key | value |\n|---|---|\n" + table, 0)
        self._closed = False

    def record(self, record: VersionRecord) -> None:
        for name, value in series(record).items():
            self._writer.add_scalar(name, value, record.round)
        # A killed run keeps what it logged: the runs directory is read while jobs run.
        self._writer.flush()

    def finish(self, status: str) -> None:
        if not self._closed:
            self._closed = True
            self._writer.add_text("status", status, 0)
            self._writer.close()


class MlflowSink:
    """One MLflow run per job, its parameters the job's config, its metrics the records; the
    run ends FINISHED or FAILED with the job. By default in the file store `<run_dir>/mlruns/`
    (no server: `mlflow ui --backend-store-uri <run_dir>/mlruns`); `uri` names another
    tracking store (a database, a server)."""

    def __init__(
        self,
        run_dir: Path,
        experiment: str,
        run_name: str,
        params: Mapping[str, str],
        uri: str,
        *,
        resume: bool = False,
    ) -> None:
        tracking = _library("mlflow.tracking", "mlflow")
        self.store_dir = run_dir / MLFLOW_DIR
        if not uri:
            # MLflow 3 keeps its file store in maintenance and refuses it unless opted in; it
            # is the one store that needs no server or database, so a run opts in (unless its
            # environment says otherwise).
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = tracking.MlflowClient(tracking_uri=uri or self.store_dir.resolve().as_uri())
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        entities = importlib.import_module("mlflow.entities")
        self._metric = entities.Metric
        self._param = entities.Param
        self._ended = False
        earlier = self._run_named(experiment_id, run_name) if resume else None
        if earlier is not None:
            # A resumed job goes on in the run it started: one metric history from round 1.
            # Its parameters stay as first logged (MLflow refuses to change one; a resume may
            # only change how long and how patiently the job runs).
            self.run_id: str = earlier
            self._client.update_run(self.run_id, status="RUNNING")
            return
        run = self._client.create_run(experiment_id, run_name=run_name)
        self.run_id = run.info.run_id
        self._client.log_batch(
            self.run_id,
            params=[self._param(k, v[:_MLFLOW_PARAM_CHARS]) for k, v in sorted(params.items())],
        )

    def _run_named(self, experiment_id: str, run_name: str) -> str | None:
        """The id of the latest run called `run_name` in the experiment (None: none)."""
        found = self._client.search_runs(
            [experiment_id],
            filter_string=f"attributes.run_name = '{run_name}'",
            order_by=["attributes.start_time DESC"],
            max_results=1,
        )
        return str(found[0].info.run_id) if found else None

    def record(self, record: VersionRecord) -> None:
        stamp = int(record.elapsed_s * 1000)
        metrics = [self._metric(k, v, stamp, record.round) for k, v in series(record).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def finish(self, status: str) -> None:
        if not self._ended:
            self._ended = True
            self._client.set_tag(self.run_id, "splitmq.status", status)
            ended = "FINISHED" if status == "finished" else "FAILED"
            self._client.set_terminated(self.run_id, status=ended)


def tracking_sinks(
    trackers: Sequence[str],
    run_dir: Path,
    job: str,
    config: Mapping[str, Any],
    mlflow_uri: str = "",
    *,
    resume: bool = False,
) -> list[MetricsSink]:
    """The sinks of `trackers` (names in TRACKERS) for one run directory; `config` is the
    job's settings as a nested mapping (logged as the run's parameters). `resume`: the run
    directory's job goes on (`--resume`), and so do its trackers: TensorBoard adds an event
    file beside the earlier ones in the same directory (it reads them as one series), MLflow
    logs into the run it started."""
    params = {name: str(value) for name, value in flatten(config).items()}
    sinks: list[MetricsSink] = []
    for name in trackers:
        if name == "tensorboard":
            sinks.append(TensorBoardSink(run_dir, params))
        elif name == "mlflow":
            sinks.append(MlflowSink(run_dir, job, run_dir.name, params, mlflow_uri, resume=resume))
        else:
            raise ValueError(f"unknown tracker {name!r}; known: {', '.join(TRACKERS)}")
    return sinks


def run_trackers(settings: Settings, run_dir: Path, *, resume: bool = False) -> list[MetricsSink]:
    """The trackers `settings.report.tracking` chooses, for the run in `run_dir` (none by
    default; `resume`: it goes on, see `tracking_sinks`); the config they log has its secrets
    masked, as config.toml has."""
    config = redact(settings.model_dump(mode="json"))
    report = settings.report
    return tracking_sinks(
        report.tracking, run_dir, settings.job.name, config, report.mlflow_uri, resume=resume
    )
