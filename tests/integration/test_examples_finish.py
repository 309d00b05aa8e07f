"""Every shipped config finishes: each `examples/*.toml` and `examples/experiments/*.toml`,
found by glob (a new example is covered without editing this file), runs through `splitmq run`
in a quick mode, and the job must end `finished` with finite losses and accuracy.

Quick mode is the product's own: the settings overrides `splitmq experiment NAME --quick`
applies (`Experiment.quick`) for an experiment's base config, `spec.smoke()` for the others
(2 rounds of at most 3 local steps, fewer test images), given as `SPLITMQ_<SECTION>__<FIELD>`
environment overrides (README, "Configuration"). Neither touches the recipe: the learning
rate, momentum, batch size, algorithm parameters, model and partition stay the file's, so a
recipe that blows up within its first steps (a NaN upload refused by every client fails the
job) fails here. `examples/service.toml` asks for RabbitMQ and Redis; `splitmq run` runs it on
the in-memory ones (its recipe is the quickstart's; `splitmq up` on it: test_up.py).

A quick run cannot see a divergence that builds over tens of rounds (FedDeper's base config
went to NaN at round 26 of 30). That is guarded separately and cheaply in
tests/unit/test_feddeper_stability.py: FedDeper's real client round and aggregation, with the
experiment file's hyper-parameters, for all of its rounds on a tiny model.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.experiments.registry import get_experiment
from services.experiments.spec import smoke

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# The paper settings (`<name>-paper.toml`) are left out: several are ResNet-18 grids for a GPU
# (one round takes tens of minutes on 2 cores); their every run is validated without training
# by tests/unit/test_experiments.py, and `--paper` shares the runner with the scaled grid.
CONFIGS = sorted(EXAMPLES.glob("*.toml")) + sorted(
    p for p in (EXAMPLES / "experiments").glob("*.toml") if not p.stem.endswith("-paper")
)
# Where the runs are not the point: no metrics server or dashboard, no plots.
QUIET = {"SPLITMQ_METRICS__ENABLED": "false", "SPLITMQ_REPORT__PLOTS": "false"}


def quick_overrides(path: Path) -> dict[str, Any]:
    """The overrides of the file's quick mode (module docstring)."""
    if path.parent.name == "experiments":
        return dict(get_experiment(path.stem).quick)
    return smoke()


def as_env(overrides: Mapping[str, Any], prefix: str = "SPLITMQ_") -> Iterator[tuple[str, str]]:
    """`{"job": {"rounds": 2}}` as `("SPLITMQ_JOB__ROUNDS", "2")`."""
    for key, value in overrides.items():
        name = f"{prefix}{key.upper()}"
        if isinstance(value, Mapping):
            yield from as_env(value, f"{name}__")
        else:
            yield name, str(value).lower() if isinstance(value, bool) else str(value)


def test_the_quick_overrides_keep_the_recipe() -> None:
    recipe = {"lr", "momentum", "batch_size", "server_lr", "name"}
    for path in CONFIGS:
        quick = quick_overrides(path)
        assert not recipe & set(quick.get("algorithm", {})), path.name
        assert "model" not in quick, path.name
    assert dict(as_env({"job": {"rounds": 2}, "metrics": {"enabled": False}})) == {
        "SPLITMQ_JOB__ROUNDS": "2",
        "SPLITMQ_METRICS__ENABLED": "false",
    }


def run_quick(path: Path, report_dir: Path, data_dir: str, job: str) -> tuple[Path, int]:
    """`splitmq run` on `path` in its quick mode; the run directory and the rounds asked for."""
    env: dict[str, str | None] = dict(as_env(quick_overrides(path)))
    # The full datasets from the data directory, the shipped sample from the package.
    env |= QUIET | {"SPLITMQ_JOB__NAME": job, "SPLITMQ_DATA_DIR": data_dir, "SPLITMQ_CONFIG": None}
    args = ["run", str(path), "--report-dir", str(report_dir)]
    result = CliRunner().invoke(cli, args, env=env)
    assert result.exit_code == 0, result.output
    (run_dir,) = report_dir.iterdir()
    return run_dir, int(env["SPLITMQ_JOB__ROUNDS"] or 0)


# What a run's metrics say about its training, not about the machine's speed: equal in two
# deterministic runs of one config and seed (elapsed time, throughput and bytes are not).
TRAINING_COLUMNS = (
    "version",
    "round",
    "participants",
    "global_accuracy",
    "global_loss",
    "personal_accuracy",
    "train_loss",
    "train_accuracy",
    "samples",
)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_example_finishes_in_quick_mode(
    path: Path, tmp_path: Path, data_dir: str, job: str
) -> None:
    """Every example finishes; each top-level one (one per algorithm and mode) run twice with
    its seed gives the same model file byte for byte and the same training metrics (issue 36:
    `job.deterministic`, the default)."""
    run_dir, rounds = run_quick(path, tmp_path / "first", data_dir, job)
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished", doc["run"]
    records = doc["records"]
    assert len(records) == rounds, [r["version"] for r in records]
    for record in records:
        losses = (record["train_loss"], record["global_loss"])
        assert all(math.isfinite(loss) for loss in losses), record
    last = records[-1]
    assert math.isfinite(last["global_accuracy"]), last
    if path.parent != EXAMPLES:
        return  # the experiments' bases repeat the examples' algorithms
    if doc["run"]["schedule"].startswith("free-running, async"):
        pytest.xfail("deterministic async runs are not built yet (issue 36)")
    assert doc["run"]["schedule"].startswith("deterministic"), doc["run"]
    again, _ = run_quick(path, tmp_path / "second", data_dir, job)
    model = (run_dir / "model.safetensors").read_bytes()
    assert model == (again / "model.safetensors").read_bytes(), f"{path.name}: models differ"
    second = json.loads((again / "metrics.json").read_text())["records"]
    trained = [[r[k] for k in TRAINING_COLUMNS] for r in records]
    assert trained == [[r[k] for k in TRAINING_COLUMNS] for r in second], path.name
