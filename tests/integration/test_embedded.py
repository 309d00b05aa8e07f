"""`splitmq run`: the real roles on threads over the in-memory broker and store."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.common.backends import Backends
from services.common.supervise import Role
from services.config.root import Settings
from services.runtime import roles

pytestmark = pytest.mark.slow

TINY = """
[job]
name = "{name}"
rounds = {rounds}

[data]
dataset = "fashion_mnist_sample"
eval_samples = 500

[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = {steps}

[clients]
count = 2
min_to_start = 2

[report]
dir = "{runs}"
"""


def write_config(tmp_path: Path, *, rounds: int = 1, steps: int = 15, name: str = "tiny") -> Path:
    path = tmp_path / "tiny.toml"
    text = TINY.format(name=name, rounds=rounds, steps=steps, runs=tmp_path / "runs")
    path.write_text(text)
    return path


def run_dir_of(tmp_path: Path) -> Path:
    dirs = list((tmp_path / "runs").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def test_run_trains_above_chance_and_writes_the_run_directory(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    # The file asks for real servers: `run` must still use the in-memory ones, and say so.
    env = {"SPLITMQ_BROKER": "rabbitmq", "SPLITMQ_STORE": "redis", "SPLITMQ_CONFIG": None}
    result = CliRunner().invoke(cli, ["run", str(config)], env=env)
    assert result.exit_code == 0, result.output
    assert "using the in-memory broker and store" in result.stderr
    assert "| sfl_v2 | 2 clients | fashion_mnist_sample | S=1 | 1 rounds" in result.stdout
    assert "round 1/1  v2  global" in result.stdout

    run_dir = run_dir_of(tmp_path)
    assert run_dir.name.startswith("tiny-")
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    assert len(records) >= 1
    last = records[-1]
    assert last["version"] == 2 and last["participants"] == 2
    assert last["samples"] > 0 and last["bytes_up"] > 0 and last["bytes_down"] > 0
    assert last["global_accuracy"] > 0.3, f"10 classes: chance is 0.1, got {last}"
    for name in ("config.toml", "metrics.csv", "summary.txt", "accuracy.png", "loss.png"):
        assert (run_dir / name).stat().st_size > 0, name
    summary = (run_dir / "summary.txt").read_text()
    assert summary in result.stdout
    assert 'kind = "memory"' in (run_dir / "config.toml").read_text()


class Exploding:
    def run(self, stop: threading.Event) -> None:
        raise RuntimeError("GPU caught fire")


def test_a_dying_role_stops_the_run_with_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken_worker(
        settings: Settings, backends: Backends, *, worker_id: str, script: object = None
    ) -> Role:
        return Exploding()

    monkeypatch.setattr(roles, "build_worker", broken_worker)
    config = write_config(tmp_path, rounds=3, steps=200)
    result = CliRunner().invoke(cli, ["run", str(config)], env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 1
    assert "worker-0 failed:" in result.stderr
    assert "RuntimeError: GPU caught fire" in result.stderr
    doc = json.loads((run_dir_of(tmp_path) / "metrics.json").read_text())
    assert doc["run"]["status"].startswith("failed: worker-0: RuntimeError")


def test_ctrl_c_stops_cleanly_and_keeps_a_partial_report(tmp_path: Path) -> None:
    config = write_config(tmp_path, rounds=50, steps=5)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", "run", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("round 1/50"):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output
    assert "status: stopped" in output
    doc = json.loads((run_dir_of(tmp_path) / "metrics.json").read_text())
    assert doc["run"]["status"] == "stopped"
    assert 1 <= len(doc["records"]) < 50
    assert (run_dir_of(tmp_path) / "summary.txt").is_file()


@pytest.mark.parametrize("algorithm", ["sfl_v2", "fedavg"])
def test_evaluation_off_trains_without_testing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    """`[evaluation] enabled = false`: the rounds train, no version is evaluated (accuracy
    null in metrics.json, n/a in the summary), the aggregator builds no evaluator and
    whole-model clients report no local accuracy."""
    from services.aggregator import evaluation

    def no_evaluator(*args: object, **kwargs: object) -> None:
        raise AssertionError("an evaluator was built with evaluation off")

    monkeypatch.setattr(evaluation, "build_evaluator", no_evaluator)
    config = write_config(tmp_path, rounds=2, steps=5)
    text = config.read_text().replace('name = "sfl_v2"', f'name = "{algorithm}"')
    config.write_text(text + "\n[evaluation]\nenabled = false\n")
    result = CliRunner().invoke(cli, ["run", str(config)], env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    doc = json.loads((run_dir_of(tmp_path) / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    assert [r["version"] for r in doc["records"]] == [2, 3]
    assert all(r["global_accuracy"] is None for r in doc["records"])
    assert all(r["personal_accuracy"] is None for r in doc["records"])
    assert all(r["samples"] > 0 for r in doc["records"])
    assert "final global accuracy    n/a" in result.stdout
