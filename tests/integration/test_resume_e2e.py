"""Stop a job with Ctrl-C after round 2 and go on with `--resume RUN_DIR`: `splitmq run` (its
run directory keeps the version) and `splitmq up` (the versions stay in Redis).

What must hold across the stop: the versions go on from the stopped run's (3 -> 4, 5; not from
1), metrics.json holds every round once and in order, elapsed time goes on, the first resumed
round starts from the trained weights (its training loss is far below the first round's,
which a restart from the seeded model would repeat; its accuracy is near the stopped run's
and far above chance), and every client of the resumed run trains in each of its rounds (no
batch or update refused as `not_in_cohort`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.config.loading import load_settings
from services.runtime.processes import clear_job

pytestmark = pytest.mark.slow

ROUNDS = 4
STOP_AFTER = 2  # rounds recorded before the Ctrl-C
CLIENTS = 2

CONFIG = """
[job]
name = "set-by-env"
rounds = {rounds}

[data]
dataset = "fashion_mnist_sample"
eval_samples = 500

[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 6

[clients]
count = {clients}
min_to_start = {clients}
# The processes of `up` import torch at once on a small shared machine: patient heartbeats.
heartbeat_ttl_s = 60

[workers]
count = 1

[report]
dir = "{runs}"
"""


def environment(job: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    return {**env, "SPLITMQ_JOB__NAME": job, **extra}


def stopped_after_round(argv: list[str], env: dict[str, str], rounds: int) -> str:
    """Run `splitmq ARGV` until it prints round `rounds`'s progress line, then Ctrl-C it; its
    whole output (it must end as stopped, 130)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli.main", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    seen = []
    wanted = re.compile(rf"(^|\| )round {rounds}/{ROUNDS} ")
    try:
        for line in proc.stdout:
            seen.append(line)
            if wanted.search(line):
                proc.send_signal(signal.SIGINT)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = "".join(seen) + rest
    assert proc.returncode == 130, output[-6000:]
    return output


def splitmq(argv: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    return output


def the_run_dir(runs: Path) -> Path:
    (run_dir,) = runs.iterdir()
    return run_dir


def records_of(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    doc = json.loads((run_dir / "metrics.json").read_text())
    return doc["run"], doc["records"]


def assert_continued(run_dir: Path, before: list[dict[str, Any]], resumed_output: str) -> None:
    """`before`: the rows when the run stopped (the Ctrl-C may land a round after STOP_AFTER)."""
    run, records = records_of(run_dir)
    k = len(before)
    assert STOP_AFTER <= k < ROUNDS, before
    assert run["status"] == "finished"
    assert "resumed_at" in run["extra"]
    # Every round once, in order; versions 2..ROUNDS+1, the resumed ones going on from k+1.
    assert [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    assert [r["version"] for r in records] == list(range(2, ROUNDS + 2))
    assert records[:k] == before, "the rows of the stopped run changed"
    assert re.search(rf"resuming (job \S+ )?at version {k + 1}\b", resumed_output)
    elapsed = [r["elapsed_s"] for r in records]
    assert all(a < b for a, b in itertools.pairwise(elapsed)), elapsed
    last, first_resumed = before[-1], records[k]
    # Trained weights, not the seeded model again: the first round trains from the seed.
    assert first_resumed["train_loss"] < 0.85 * records[0]["train_loss"], records
    # 500 test images: one round of 6 steps moves the accuracy by a few points either way.
    assert first_resumed["global_accuracy"] >= last["global_accuracy"] - 0.15, records
    assert first_resumed["global_accuracy"] > 0.3  # chance is 0.1
    # Every client trained in every resumed round; the worker refused no batch.
    assert [r["participants"] for r in records[k:]] == [CLIENTS] * (ROUNDS - k)
    assert "dead_lettered=Counter()" in resumed_output, resumed_output[-6000:]
    assert "not_in_cohort" not in resumed_output


@pytest.mark.timeout(300)
def test_splitmq_run_goes_on_after_ctrl_c(tmp_path: Path, job: str) -> None:
    runs = tmp_path / "runs"
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.format(rounds=ROUNDS, clients=CLIENTS, runs=runs))
    env = environment(job)
    logs = ["--log-level", "INFO"]  # the worker's stop line counts its dead letters

    stopped = stopped_after_round(["run", str(config), *logs], env, STOP_AFTER)
    run_dir = the_run_dir(runs)
    run, before = records_of(run_dir)
    assert "status: stopped" in stopped and run["status"] == "stopped"
    assert (run_dir / "version.safetensors").is_file()

    resumed = splitmq(["run", str(config), "--resume", str(run_dir), *logs], env)

    assert list(runs.iterdir()) == [run_dir], "a second run directory"
    assert_continued(run_dir, before, resumed)
    assert "status: finished" in resumed


@pytest.fixture
def up_config(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str
) -> Iterator[tuple[Path, dict[str, str]]]:
    config = tmp_path / "job.toml"
    config.write_text(CONFIG.format(rounds=ROUNDS, clients=CLIENTS, runs=tmp_path / "runs"))
    env = environment(job, SPLITMQ_AMQP_URL=amqp_url, SPLITMQ_REDIS_URL=redis_url)
    yield config, env
    servers = {**env, "SPLITMQ_BROKER": "rabbitmq", "SPLITMQ_STORE": "redis"}
    clear_job(load_settings(config, servers), [f"client-{i}" for i in range(CLIENTS)])


@pytest.mark.rabbitmq
@pytest.mark.redis
@pytest.mark.timeout(600)
def test_splitmq_up_goes_on_after_ctrl_c(up_config: tuple[Path, dict[str, str]]) -> None:
    config, env = up_config
    runs = config.parent / "runs"
    logs = ["--log-level", "INFO"]

    stopped = stopped_after_round(["up", str(config), *logs], env, STOP_AFTER)
    assert "splitmq up: stopped" in stopped
    run_dir = the_run_dir(runs)
    run, before = records_of(run_dir)
    assert run["status"] == "stopped"

    resumed = splitmq(["up", str(config), "--resume", str(run_dir), *logs], env)

    assert list(runs.iterdir()) == [run_dir], "a second run directory"
    assert_continued(run_dir, before, resumed)
    # The resumed round opened with every client (not with the first to rejoin).
    k = len(before)
    # Logs count rounds from 1: version k + 1 is trained by round k + 1.
    opened = re.search(rf"round {k + 1} opened \(version {k + 1}, cohort \[(.*?)\]\)", resumed)
    assert opened is not None, resumed[-6000:]
    assert opened.group(1) == ", ".join(f"'client-{i}'" for i in range(CLIENTS))
