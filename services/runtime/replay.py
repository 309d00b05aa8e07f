"""`splitmq replay RUN_DIR`: a run's schedule executed again in one process (issue 36).

The run's own config.toml and schedule.jsonl.gz say what to run and in which order; the job is
run embedded (the in-memory broker and store), with the torch threads the record names, into
`RUN_DIR/replay/`, where it keeps its own model, record and metrics. Its aggregator takes the
run's cohort for each round and its workers serve each shard's batches in the run's recorded
order (`workers.sequencer.RecordedOrder`). The replay's record is then held
against the run's (`services.common.schedule_compare`): the batch order of every shard, the
weights at every checkpoint both wrote, and every version's weights; the first difference is
said, with where it is. A record that ends early (a role killed before it wrote) is replayed up
to its last recorded version, and the replay says so.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.backends import Backends
from services.common.schedule import Header
from services.common.schedule_compare import (
    first_divergence,
    folds,
    last_version,
    shard_names,
)
from services.common.schedule_file import SCHEDULE_FILE, Schedule, read_schedule_file
from services.common.supervise import RoleSpec
from services.config.loading import load_settings
from services.config.root import Settings
from services.data.loaders import Dataset
from services.report.filesink import FileSink
from services.report.final_model import MODEL_FILE
from services.report.model_diff import TensorDiff, compare_models
from services.report.records import MetricsSink
from services.report.rundir import CONFIG_FILE
from services.report.sinks import TeeSink
from services.runtime.embedded import embedded_settings, run_embedded
from services.runtime.roles import embedded_roles
from services.runtime.threads import budgeted

REPLAY_DIR = "replay"


class ReplayError(ValueError):
    """The run directory cannot be replayed; the message says why."""


@dataclass(frozen=True)
class Replayed:
    run_dir: Path
    out_dir: Path
    status: str  # the replay job's outcome ("finished", "failed: ...")
    versions: int  # the last version the record has and the replay reproduced or not
    incomplete: str  # "" when the record covers the whole run, else why not
    divergence: str | None  # None: the replay reproduced the record
    diffs: list[TensorDiff] | None  # with `check`: the run's model against the replay's

    @property
    def identical(self) -> bool:
        return self.diffs is not None and all(d.identical for d in self.diffs)


def load_run(run_dir: Path, data_dir: Path | None = None) -> tuple[Settings, Schedule]:
    """The run's settings and record; `ReplayError` naming what is missing or unreadable.
    `data_dir`: where the datasets are on this machine, in place of the run's `data.dir` (a
    location, not something the model depends on)."""
    config, record = run_dir / CONFIG_FILE, run_dir / SCHEDULE_FILE
    for path, what in ((config, "its config"), (record, "its schedule record")):
        if not path.is_file():
            raise ReplayError(
                f"{run_dir} is not a replayable run directory: no {path.name} "
                f"({what}; runs record one since issue 36)"
            )
    try:
        settings = load_settings(config)
        schedule = read_schedule_file(record)
        if data_dir is not None:
            data = settings.data.model_copy(update={"dir": str(data_dir)})
            settings = settings.model_copy(update={"data": data})
    except ValueError as exc:
        raise ReplayError(str(exc)) from None
    if schedule.header.mode != "sync":
        raise ReplayError(
            f"{run_dir}: an {schedule.header.mode} run; replaying asynchronous runs is not "
            "built yet (docs/reproducibility.md)"
        )
    return settings, schedule


def replay_settings(settings: Settings, header: Header, versions: int) -> Settings:
    """The run's settings for the replay: embedded, the record's torch threads, rounds up to
    the last recorded version, in the run's deterministic mode, reporting nowhere else."""
    settings, _ = embedded_settings(settings)
    runtime = settings.runtime.model_copy(update={"torch_threads": max(header.torch_threads, 1)})
    job = settings.job.model_copy(
        update={"rounds": max(versions - 1, 1), "deterministic": header.deterministic}
    )
    metrics = settings.metrics.model_copy(update={"enabled": False, "dashboard": False})
    return settings.model_copy(update={"runtime": runtime, "job": job, "metrics": metrics})


def replay_run(
    run_dir: Path,
    *,
    sink: MetricsSink,
    stop: threading.Event,
    check: bool = False,
    out_dir: Path | None = None,
    data_dir: Path | None = None,
    log: logging.Logger | None = None,
) -> Replayed:
    """Replay `run_dir` into `out_dir` (default `run_dir/replay`, replaced) and compare."""
    log = log or logging.getLogger("splitmq.replay")
    settings, recorded = load_run(run_dir, data_dir)
    versions = last_version(recorded)
    wanted = settings.job.rounds + 1
    incomplete = ""
    if versions < wanted:
        incomplete = (
            f"the record ends at version {versions} of {wanted} (a role stopped before it "
            f"wrote the rest): replayed up to version {versions}"
        )
    if versions < 2:
        raise ReplayError(f"{run_dir}: the record has no published version to replay")
    settings = replay_settings(settings, recorded.header, versions)
    out = out_dir or run_dir / REPLAY_DIR
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    # The replay's own metrics.json, config.toml and plots beside its model and record.
    files = FileSink.create(settings, command=f"splitmq replay {run_dir}", run_dir=out)
    sink = TeeSink([files, sink])
    cohorts = {f.round: f.cohort for f in folds(recorded).values() if f.cohort}
    # Every shard serves its batches in the recorded order, whatever the run's mode: a
    # free-running run's arrival order, or a deterministic one's that a timeout bent.
    streams = recorded.streams
    scripts = {int(name.removeprefix("shard-")): streams[name] for name in shard_names(recorded)}

    def roles(s: Settings, b: Backends, m: MetricsSink, d: Dataset) -> Sequence[RoleSpec]:
        return embedded_roles(s, b, m, d, cohorts=cohorts, scripts=scripts)

    with budgeted(settings):  # the record's torch threads: another count, other sums
        outcome = run_embedded(
            settings, sink=sink, stop=stop, run_dir=out, logger=log, build_roles=roles
        )
    replayed = read_schedule_file(out / SCHEDULE_FILE)
    divergence = first_divergence(recorded, replayed, up_to=versions)
    diffs = None
    if check:
        diffs = compare_models(_checked_model(run_dir, versions, wanted), out / MODEL_FILE)
    return Replayed(run_dir, out, outcome.status, versions, incomplete, divergence, diffs)


def _checked_model(run_dir: Path, versions: int, wanted: int) -> Path:
    """The run's model to compare with: model.safetensors, which holds its last version."""
    model = run_dir / MODEL_FILE
    if not model.is_file():
        raise ReplayError(f"{run_dir}: no {MODEL_FILE} to check the replay against")
    if versions < wanted:
        # The run's model is of a later version than the record reaches: not comparable.
        raise ReplayError(
            f"{run_dir}: the record ends at version {versions}, the run's model is of a later "
            "one; replay without --check to see how far the record is reproduced"
        )
    return model
