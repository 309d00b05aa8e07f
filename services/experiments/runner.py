"""Run every job of an experiment in this process and collect the results (CONTRIBUTING.md,
"Adding an experiment"): service runs through the embedded runner, centralized ones through
`services.experiments.centralized`. Each run's report directory also gets `experiment.json`
(its tags, wall time and config); results are read back from there, not kept in memory.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError

from broker.store import NO_VERSION
from services.aggregator.core import read_version
from services.common.backends import Backends, Embedded
from services.common.schedule_file import SCHEDULE_FILE, keep_schedule
from services.config.loading import ConfigError, deep_merge
from services.config.root import Settings
from services.config.settings import ConnectionSettings
from services.data.loaders import Dataset, load_dataset
from services.experiments.centralized import train_centralized
from services.experiments.experiment import Experiment
from services.experiments.results import (
    EXPERIMENT_JSON,
    FINAL_JSON,
    ResultSet,
    RunResult,
    load_result,
    settled_status,
)
from services.experiments.spec import FinalEval, Run
from services.experiments.watchdog import run_stop
from services.report.filesink import FileSink, read_records
from services.report.records import MetricsSink
from services.report.rundir import CONFIG_FILE, METRICS_JSON, write_atomic
from services.report.sinks import EchoSink, RecordsOnly, TeeSink
from services.report.tracking import run_trackers
from services.runtime.embedded import embedded_settings, run_embedded, schedule_header
from services.runtime.roles import embedded_roles

Echo = Callable[[str], None]
# Settings that say where things are, not what is computed: a run is reusable across them.
_LOCATION_KEYS = (("data", "dir"), ("report", "dir"))


def slug(label: str) -> str:
    """`label` as a directory and job name (`^[A-Za-z0-9_-]{1,64}$`)."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", label).strip("_")[:64] or "run"


def build_settings(
    experiment: Experiment,
    run: Run,
    *,
    quick: bool,
    data_dir: str | None = None,
    seed: int | None = None,
) -> Settings:
    """Base config, then the --quick overrides, then the run's own, then where the data is
    (and `seed` as job.seed, when given)."""
    merged = deep_merge(dict(experiment.base), experiment.quick if quick else {})
    merged = deep_merge(merged, run.overrides)
    merged = deep_merge(merged, {"job": {"name": slug(run.label)}, "data": {"dir": data_dir or ""}})
    if seed is not None:
        merged = deep_merge(merged, {"job": {"seed": seed}})
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"experiment {experiment.name}, run {run.label}: {problems}") from None


def comparable(settings: Settings) -> dict[str, Any]:
    """The settings that decide a run's numbers: no locations, no connections (an experiment
    runs on the in-memory broker and store whatever the file says)."""
    return _numbers_only(settings.model_dump(mode="json"))


def _numbers_only(dumped: dict[str, Any]) -> dict[str, Any]:
    dumped = {k: dict(v) if isinstance(v, dict) else v for k, v in dumped.items()}
    for key in ConnectionSettings.model_fields:
        dumped.pop(key, None)
    for section, key in _LOCATION_KEYS:
        dumped.get(section, {}).pop(key, None)
    return dumped


def same_settings(stored: Any, current: Any, defaults: Any) -> bool:
    """Whether a run recorded with `stored` settings is a run of `current`.

    A setting added to SplitMQ since that run is absent from `stored`; it matches when
    `current` leaves it at its default, which keeps the behaviour the run had.
    """
    if not (isinstance(stored, dict) and isinstance(current, dict)):
        return bool(stored == current)
    default = defaults if isinstance(defaults, dict) else {}
    for key, value in current.items():
        if key in stored:
            if not same_settings(stored[key], value, default.get(key)):
                return False
        elif key not in default or value != default[key]:
            return False
    return all(key in current for key in stored)


def reusable(run_dir: Path, settings: Settings) -> bool:
    """Whether `run_dir` holds a settled earlier run of exactly these settings: finished, or
    failed by itself (`RunResult.settled`)."""
    try:
        meta = json.loads((run_dir / EXPERIMENT_JSON).read_text(encoding="utf-8"))
        info, records = read_records(run_dir)
    except (OSError, ValueError, KeyError, TypeError):
        return False
    defaults = comparable(Settings())
    stored = meta.get("config")
    if not isinstance(stored, dict):
        return False
    same = same_settings(_numbers_only(stored), comparable(settings), defaults)
    return same and settled_status(str(info.get("status", "")), len(records), settings.job.rounds)


def machine_line() -> str:
    """OS, CPU, cores, Python, torch and its intra-op threads (experiments share hosts)."""
    return ", ".join(
        [
            platform.platform(),
            platform.processor() or platform.machine(),
            f"{os.cpu_count()} CPUs",
            f"python {platform.python_version()}",
            f"torch {torch.__version__} ({torch.get_num_threads()} intra-op threads)",
        ]
    )


def run_service(
    settings: Settings,
    dataset: Dataset,
    sink: MetricsSink,
    stop: threading.Event,
    run_dir: Path,
    final_eval: FinalEval | None = None,
    client_slots: int | None = 0,
) -> None:
    """Run the job embedded; then `final_eval` its last published version into final.json
    (the embedded runner is given its hub, so its store still holds the versions).
    `client_slots`: clients in whole-model work at once (`embedded_roles`)."""
    embedded, _ = embedded_settings(settings)
    hub = Embedded()
    backends = Backends(embedded.broker, embedded.store, hub)
    run_embedded(
        settings,
        sink=sink,
        stop=stop,
        dataset=dataset,
        backends=backends,
        build_roles=functools.partial(embedded_roles, compute_slots=client_slots),
    )
    job = settings.job.name
    # The run's record, to replay it (`splitmq replay RUN_DIR`, docs/reproducibility.md).
    keep_schedule(run_dir, hub.store, job, schedule_header(settings), logging.getLogger(__name__))
    version = hub.store.current_version(job)
    if final_eval is None or version == NO_VERSION:
        return
    metrics = dict(final_eval(settings, dataset, read_version(hub.store, job, version)))
    metrics["version"] = float(version)
    write_atomic(run_dir / FINAL_JSON, json.dumps(metrics, indent=1, sort_keys=True) + "\n")


def execute(
    experiment: Experiment,
    run: Run,
    settings: Settings,
    dataset: Dataset,
    run_dir: Path,
    *,
    command: str,
    echo: Echo,
    stop: threading.Event,
    client_slots: int | None = 0,
) -> float:
    """Run one job into `run_dir`; its wall time in seconds (a service run's `final_eval`
    included). A run that publishes no version for `stall_s` seconds is stopped."""
    stall_s = experiment.stall_s
    sink = FileSink.create(settings, command=command, run_dir=run_dir)
    # A short line per round; the runner prints the run's end itself, with its wall time.
    progress = EchoSink(lambda line: echo(f"  [{run.label}] {line}"), rounds=settings.job.rounds)
    try:
        load: float | None = os.getloadavg()[0]
    except OSError:  # no load average on this OS
        load = None
    started = time.monotonic()
    stalled = f"  [{run.label}] no new version for {stall_s:.0f} s: stopping the run"
    with run_stop(stop, stall_s, on_stall=lambda: echo(stalled)) as (this_run, beat):
        tee = TeeSink([sink, *run_trackers(settings, run_dir), RecordsOnly(progress), beat])
        if run.kind == "centralized":
            train_centralized(settings, dataset, tee, this_run)
        else:
            run_service(
                settings, dataset, tee, this_run, run_dir, experiment.final_eval, client_slots
            )
    wall_s = time.monotonic() - started
    meta = {
        "label": run.label,
        "tags": dict(run.tags),
        "kind": run.kind,
        "wall_s": wall_s,
        "machine": machine_line(),
        "load": load,
        "config": comparable(settings),
    }
    write_atomic(run_dir / EXPERIMENT_JSON, json.dumps(meta, indent=2) + "\n")
    return wall_s


# What a run's results are read back from (`load_result`, `reusable`), and what replays it
# (its config and schedule record); weights stay behind: the record's digests check a replay.
ARCHIVED = (METRICS_JSON, EXPERIMENT_JSON, FINAL_JSON, CONFIG_FILE, SCHEDULE_FILE)


def keep(run_dir: Path, kept: Path) -> None:
    """Copy the run's `ARCHIVED` files from `run_dir` to `kept`."""
    kept.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVED:
        if (run_dir / name).exists():
            shutil.copyfile(run_dir / name, kept / name)


def _eta(done_s: float, done: int, total: int) -> str:
    left = done_s / done * (total - done)
    return f", about {left / 60:.0f} min left" if left >= 60 else f", about {left:.0f} s left"


def seeded(
    experiment: Experiment, run: Run, seeds: int, *, quick: bool, data_dir: str | None
) -> list[tuple[Settings, str]]:
    """The settings and directory name of each seed of `run`: its own seed first (in the
    directory an unseeded experiment uses, so earlier runs stay reusable), then the next ones."""
    first = build_settings(experiment, run, quick=quick, data_dir=data_dir)
    out = [(first, slug(run.label))]
    for offset in range(1, seeds):
        seed = first.job.seed + offset
        settings = build_settings(experiment, run, quick=quick, data_dir=data_dir, seed=seed)
        out.append((settings, f"{slug(run.label)}-seed{seed}"))
    return out


def run_experiment(
    experiment: Experiment,
    *,
    runs_dir: Path,
    quick: bool = False,
    data_dir: str | None = None,
    reuse: bool = False,
    command: str = "",
    echo: Echo = print,
    stop: threading.Event | None = None,
    only: Callable[[Run], bool] | None = None,
    seeds: int = 1,
    archive: Path | None = None,
    client_slots: int | None = 0,
) -> ResultSet:
    """Every run of the experiment (the --quick grid when `quick`), in order, each `seeds`
    times: job.seed s, s+1, ... from the run's configured seed s, into `<label>` for the first
    and `<label>-seed<n>` for the others.

    With `reuse`, a run whose directory already holds a finished run of the same settings is
    read back instead of trained again (an interrupted experiment resumes where it stopped).
    Stops early, with the results so far, when `stop` is set.

    With `archive`, each finished run's numbers (the small files its results are read from,
    `ARCHIVED`) are also kept in `archive/<name>/<directory>/`, and `reuse` reads a run back
    from there when its report directory is gone: a grid too long for one sitting (or one
    machine) is run in parts, and the parts are kept with the results they produced.

    `client_slots`: each run's clients in whole-model work at once (0: one per core; 1 when
    several experiment processes share the machine).
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    stop = stop or threading.Event()
    grid = [r for r in experiment.grid(quick) if only is None or only(r)]
    planned = [
        (run, settings, directory)
        for run in grid
        for settings, directory in seeded(experiment, run, seeds, quick=quick, data_dir=data_dir)
    ]
    datasets: dict[tuple[str, str], Dataset] = {}  # each loaded once, shared read-only
    base = runs_dir / experiment.name
    results: list[RunResult] = []
    trained_s, trained = 0.0, 0
    for i, (run, settings, directory) in enumerate(planned, start=1):
        if stop.is_set():
            break
        run_dir = base / directory
        seed = settings.job.seed
        label = run.label if seeds == 1 else f"{run.label} (seed {seed})"
        # A run the experiment evaluates at its end is reusable only with that evaluation.
        evaluated = experiment.final_eval is None or run.kind != "service"
        kept = archive / experiment.name / directory if archive is not None else None
        found = [d for d in (run_dir, kept) if d is not None] if reuse else []
        found = [
            d for d in found if reusable(d, settings) and (evaluated or (d / FINAL_JSON).exists())
        ]
        if found:
            echo(f"[{i}/{len(planned)}] {label}: reusing {found[0]}")
            results.append(load_result(run, found[0], reused=True, seed=seed))
            if kept is not None and found[0] != kept:
                keep(run_dir, kept)
            continue
        described = ", ".join(f"{k}={v}" for k, v in run.tags.items())
        echo(f"[{i}/{len(planned)}] {label} ({described})")
        key = (settings.data.dataset, settings.data.dir)
        if key not in datasets:
            datasets[key] = load_dataset(key[0], key[1] or None)
        wall_s = execute(
            experiment,
            run,
            settings,
            datasets[key],
            run_dir,
            command=command,
            echo=echo,
            stop=stop,
            client_slots=client_slots,
        )
        result = load_result(run, run_dir, seed=seed)
        results.append(result)
        if kept is not None and result.settled:
            keep(run_dir, kept)
        trained_s, trained = trained_s + wall_s, trained + 1
        eta = _eta(trained_s, trained, trained + len(planned) - i)
        final = 100 * result.metric("final_global")
        echo(
            f"  {label}: {result.status} in {wall_s:.1f} s, final global accuracy {final:.1f}%{eta}"
        )
    return ResultSet(results)
