"""Going on with a stopped run in its own run directory (`splitmq run|up --resume RUN_DIR`).

The command is given the job's CONFIG again (the run directory's config.toml has its secrets
masked, so it is no config to run with); it must agree with the run's config.toml on what the
trained weights depend on, and may change the rest (`MAY_CHANGE`): more `job.rounds` to train
further, deadlines, logging, metrics, workers. The metrics rows after the version the job goes
on from are dropped: those rounds are trained again.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from services.config.loading import ConfigError, read_toml
from services.config.root import Settings
from services.report.filesink import read_records, write_records
from services.report.records import VersionRecord
from services.report.rundir import CONFIG_FILE, METRICS_JSON
from services.report.tomlwrite import flatten
from services.report.version_file import VERSION_FILE, SavedVersion, load_version

# What a resumed run may change, by dotted name or section: how long and how patiently it runs,
# where it reports, what it runs on. Everything else, a section added later included, is what
# the trained weights depend on, and must stay.
MAY_CHANGE = (
    "job.rounds",
    "data.dir",
    "data.eval_samples",
    "clients.min_to_start",
    "clients.start_timeout_s",
    "clients.heartbeat_s",
    "clients.heartbeat_ttl_s",
    "clients.reply_timeout_s",
    "rounds.deadline_s",
    "rounds.quorum",
    "rounds.replica_timeout_s",
    "rounds.max_empty_attempts",
    "workers",
    "evaluation",
    "report",
    "metrics",
    "autoscaler",
    "runtime",
    "broker",
    "store",
    "security",
    "log_level",
    "log_format",
)


class ResumeError(ConfigError):
    """The run directory cannot be continued (with this config); the message says why."""


def what_matters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the trained weights depend on, by dotted name (None values left out: TOML
    has no null, so the saved file has none)."""
    return {
        key: list(value) if isinstance(value, tuple) else value
        for key, value in flatten(config).items()
        if value is not None
        and not any(key == name or key.startswith(f"{name}.") for name in MAY_CHANGE)
    }


def config_differences(saved: Mapping[str, Any], settings: Settings) -> list[str]:
    """What the run's config (`saved`, as config.toml holds it) and `settings` disagree on."""
    before = what_matters(saved)
    now = what_matters(settings.model_dump(mode="json"))
    return [
        f"{key} = {before.get(key)!r} in the run, {now.get(key)!r} now"
        for key in sorted(before.keys() | now.keys())
        if before.get(key) != now.get(key)
    ]


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[VersionRecord]]:
    """metrics.json of a run directory: its run info and its records."""
    if not run_dir.is_dir():
        raise ResumeError(f"--resume {run_dir}: no such directory")
    try:
        return read_records(run_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(
            f"--resume {run_dir}: not a run directory of splitmq run or up "
            f"({run_dir / METRICS_JSON}: {exc})"
        ) from None


def check_config(run_dir: Path, settings: Settings) -> None:
    """Refuse to go on with `run_dir` under settings its weights do not fit."""
    read_run(run_dir)  # a clear error for what is no run directory
    differences = config_differences(read_toml(run_dir / CONFIG_FILE), settings)
    if differences:
        raise ResumeError(
            f"cannot resume {run_dir} with this config: it differs from the run's in what the "
            f"trained weights depend on: {'; '.join(differences)}. Resume with the config the "
            f"run was started with (compare {run_dir / CONFIG_FILE}), or start a new run"
        )


def resume_problem(version: int, last_recorded: int, rounds: int, lag: int = 0) -> str | None:
    """Why a job at `version` (0: none) cannot go on from a run whose last metrics row is
    `last_recorded` (0: none) with `rounds` to train; None when it can. `lag`: how far the
    version may be behind the last row (a version written after its row)."""
    if version < 1:
        return "no version of the job is left to go on from"
    if version < last_recorded - lag:
        return (
            f"the job is at version {version}, behind the run's last recorded version "
            f"{last_recorded}: another run of the job name has replaced it"
        )
    if version - 1 >= rounds:
        return (
            f"the run trained all its {rounds} rounds already (version {version}); raise "
            "job.rounds to train further"
        )
    return None


def prepare_resume(
    run_dir: Path, version: int, rounds: int, where: str, *, lag: int = 0
) -> list[VersionRecord]:
    """Check that the run can go on from `version` (`where` names the version's home for the
    error; `lag`: see `resume_problem`) and drop its metrics rows after that version (their
    rounds are trained again); the rows kept."""
    run, records = read_run(run_dir)
    last = max((r.version for r in records), default=0)
    problem = resume_problem(version, last, rounds, lag)
    if problem is not None:
        raise ResumeError(f"cannot resume {run_dir}: {problem} ({where})")
    kept = [r for r in records if r.version <= version]
    if len(kept) != len(records):
        write_records(run_dir, run, kept)
    return kept


def saved_version(run_dir: Path, settings: Settings) -> SavedVersion:
    """The version a stopped `splitmq run` kept in `run_dir`, checked to fit `settings`, with
    the metrics rows after it dropped (`prepare_resume`)."""
    check_config(run_dir, settings)
    path = run_dir / VERSION_FILE
    if not path.is_file():
        raise ResumeError(
            f"cannot resume {run_dir}: it keeps no version to go on from ({VERSION_FILE} is "
            "missing). A run of `splitmq up` keeps its versions in Redis: resume it with "
            "`splitmq up --resume`; a run stopped before its first round closed has nothing "
            "to resume"
        )
    try:
        saved = load_version(path)
    except ValueError as exc:
        raise ResumeError(f"cannot resume {run_dir}: {exc}") from None
    # The keeper writes a version after its row: a run stopped in between keeps one less.
    where = f"kept in {VERSION_FILE}"
    prepare_resume(run_dir, saved.version, settings.job.rounds, where, lag=1)
    return saved
