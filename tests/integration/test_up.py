"""`splitmq up`: the roles as separate OS processes over real RabbitMQ and Redis.

That `up` runs a whole job across processes (every role's output, the run directory, the
summary last) is checked on the run of tests/integration/test_metrics_services.py, which
scrapes the same roles' endpoints meanwhile: one job of seven processes instead of two."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.config.loading import load_settings
from services.runtime.processes import clear_job

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"

[job]
name = "set-by-env"
rounds = 2

[data]
eval_samples = 300

[algorithm]
name = "sfl"
shards = 2
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 4

[clients]
count = 3
min_to_start = 3
# Seven processes import torch at once on a small shared machine: be patient with heartbeats.
heartbeat_ttl_s = 60

[workers]
count = 2
"""


@pytest.fixture
def config(tmp_path: Path, amqp_url: str, redis_url: str, job: str) -> Iterator[Path]:
    path = tmp_path / "service.toml"
    path.write_text(CONFIG.format(amqp_url=amqp_url, redis_url=redis_url))
    yield path
    settings = load_settings(path, {"SPLITMQ_JOB__NAME": job})
    clear_job(settings, [f"client-{i}" for i in range(3)])


def splitmq_up(args: list[str], job: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["SPLITMQ_JOB__NAME"] = job
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", "up", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(200)
def test_up_stops_everything_when_a_role_dies(config: Path, tmp_path: Path, job: str) -> None:
    # An unknown cut: the aggregator fails building version 1 and exits non-zero.
    broken = tmp_path / "broken.toml"
    broken.write_text(config.read_text() + '\n[model]\ncut = "no-such-cut"\n')
    runs = tmp_path / "runs"
    result = splitmq_up(
        [
            str(broken),
            "--workers",
            "1",
            "--clients",
            "1",
            "--report-dir",
            str(runs),
            "--timeout",
            "150",
        ],
        job,
        timeout=180,
    )
    out = result.stdout + result.stderr
    assert result.returncode == 1, out[-4000:]
    assert "splitmq up: failed: aggregator exited with code 1" in out
    assert "unknown cut 'no-such-cut'" in out
    (run_dir,) = runs.iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"].startswith("failed")
    assert doc["records"] == []
