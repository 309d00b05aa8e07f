"""A run keeps its trained model: `splitmq run` writes model.safetensors, `splitmq export`
copies it out, the README's snippet loads it, and `splitmq up`'s path reads it from Redis."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from broker.store import NO_VERSION
from services.aggregator.evaluation import evaluate
from services.algorithms.registry import build_strategy
from services.cli import run_cmd
from services.cli.main import cli
from services.common.backends import Backends
from services.common.jobdata import load_job_dataset
from services.common.jobmodel import job_model
from services.config.loading import load_settings
from services.data.loaders import Split

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = """
[job]
name = "keep"
rounds = 2

[data]
dataset = "fashion_mnist_sample"
eval_samples = 300

[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 10

[clients]
count = 2
min_to_start = 2

[report]
dir = "{runs}"
plots = false
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("keep")
    config = tmp / "tiny.toml"
    config.write_text(TINY.format(runs=tmp / "runs"))
    result = CliRunner().invoke(cli, ["run", str(config)], env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    (found,) = (tmp / "runs").iterdir()
    assert f"trained model            {found / 'model.safetensors'}" in result.stdout
    return found


def last_record(run_dir: Path) -> dict[str, float]:
    records = json.loads((run_dir / "metrics.json").read_text())["records"]
    return dict(records[-1])


def test_the_kept_model_scores_what_the_last_record_says(run_dir: Path) -> None:
    settings = load_settings(run_dir / "config.toml", {})
    model = job_model(settings)
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    last = last_record(run_dir)
    with safe_open(run_dir / "model.safetensors", framework="pt") as f:
        assert f.metadata()["version"] == str(last["version"])

    test = load_job_dataset(settings).test
    n = settings.data.eval_samples
    result = evaluate(model, model.state_dict(), Split(test.x[:n], test.y[:n]))

    assert result.accuracy == pytest.approx(last["global_accuracy"], abs=1e-9)
    assert result.loss == pytest.approx(last["global_loss"], rel=1e-5)
    assert not (run_dir / "personal").exists()  # SFL-V2 keeps no personal weights


def test_export_round_trips_and_refuses_what_is_not_there(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "model.safetensors"
    result = CliRunner().invoke(cli, ["export", str(run_dir), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}: cnn5" in result.output

    kept, exported = load_file(run_dir / "model.safetensors"), load_file(out)
    assert kept.keys() == exported.keys()
    assert all(torch.equal(kept[k], exported[k]) for k in kept)

    missing = CliRunner().invoke(cli, ["export", str(run_dir), "--out", "x", "--client", "c9"])
    assert missing.exit_code == 1
    assert "no trained model at" in missing.output and "personal/c9.safetensors" in missing.output


def test_the_readme_snippet_loads_the_exported_model(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Using the trained model") :]
    command = re.search(r"```bash\n(splitmq export .*)\n```", section)
    snippet = re.search(r"```python\n(.*?)```", section, re.S)
    assert command and snippet
    placeholder = "runs/quickstart-20261202-013000"
    assert placeholder in command[1] and placeholder in snippet[1]

    args = shlex.split(command[1].replace(placeholder, str(run_dir)))[1:]
    monkeypatch.chdir(tmp_path)  # where the command and the snippet find model.safetensors
    assert CliRunner().invoke(cli, args).exit_code == 0
    check = "\nprint('LOADED', sum(p.numel() for p in model.parameters()))\n"
    code = snippet[1].replace(placeholder, str(run_dir)) + check
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "LOADED" in proc.stdout


@pytest.mark.redis
def test_up_keeps_the_version_redis_holds(tmp_path: Path, redis_url: str, job: str) -> None:
    env = {"SPLITMQ_STORE": "redis", "SPLITMQ_REDIS_URL": redis_url, "SPLITMQ_JOB__NAME": job}
    settings = load_settings(None, {**env, "SPLITMQ_DATA__DATASET": "fashion_mnist_sample"})
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    seeded = job_model(settings, seed=settings.job.seed)
    store = Backends(settings.broker, settings.store).open_store()
    try:
        store.publish_version(job, NO_VERSION, strategy.initial_weights(seeded, "block1"))
        run_cmd._keep_model(settings, tmp_path, since=0.0)  # nothing kept by an aggregator
    finally:
        store.delete_job(job)
        store.close()
    state = load_file(tmp_path / "model.safetensors")
    expected = seeded.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[k], expected[k]) for k in state)
