"""examples/byo_model.toml: a user's non-sequential ResNet, named by its file, built with
`[model.options]` and split by torch.fx at its module `layer1`, trains through `splitmq run`
(embedded) and through `splitmq up` over the real RabbitMQ and Redis. Both run from the
repository root, as the example's header says, so the file spec resolves as a user's would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from services.common.jobmodel import job_model
from services.config.loading import load_settings
from services.report.filesink import FileSink
from services.runtime.embedded import run_embedded
from services.runtime.processes import clear_job
from tests.unit.test_worker_support import one_torch_thread

__all__ = ["one_torch_thread"]  # the autouse fixture, imported so that it applies here

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "byo_model.toml"
CLIENTS = 2
QUICK = {
    "SPLITMQ_JOB__ROUNDS": "2",
    "SPLITMQ_ALGORITHM__MAX_STEPS_PER_ROUND": "3",
    "SPLITMQ_DATA__EVAL_SAMPLES": "200",
    "SPLITMQ_CLIENTS__COUNT": str(CLIENTS),
    "SPLITMQ_CLIENTS__MIN_TO_START": str(CLIENTS),
}


def assert_trained(run_dir: Path) -> None:
    """Finished, one record per round, and every block's weights moved from version 1's."""
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished", doc["run"]
    assert [r["version"] for r in doc["records"]] == [2, 3]
    assert all(r["participants"] == CLIENTS for r in doc["records"])
    settings = load_settings(run_dir / "config.toml", {})
    assert settings.model.options == {"width": 16, "blocks": 1}
    initial = job_model(settings, seed=settings.job.seed).state_dict()  # the aggregator's v1
    trained = load_file(run_dir / "model.safetensors")
    assert trained["blocks.0.stem.0.weight"].shape[0] == 16  # the option reached the roles
    for prefix in ("blocks.0.stem.", "blocks.1.layer1.", "blocks.2.layer2.", "blocks.3.fc."):
        names = [n for n in trained if n.startswith(prefix) and n.endswith("weight")]
        assert names, prefix
        assert all(not torch.equal(trained[n], initial[n]) for n in names), prefix


@pytest.mark.timeout(180)
def test_the_example_trains_embedded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    settings = load_settings(EXAMPLE, {**QUICK, "SPLITMQ_REPORT__DIR": str(tmp_path / "runs")})
    sink = FileSink.create(settings, command="test")
    outcome = run_embedded(settings, sink=sink, stop=threading.Event(), run_dir=sink.run_dir)
    assert outcome.ok, f"{outcome.status}\n{outcome.traceback}"
    assert_trained(sink.run_dir)


@pytest.fixture
def service_env(amqp_url: str, redis_url: str, job: str) -> Iterator[dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env.update(QUICK)
    env.update(
        {
            "SPLITMQ_JOB__NAME": job,
            "SPLITMQ_AMQP_URL": amqp_url,
            "SPLITMQ_REDIS_URL": redis_url,
            # Five processes import torch at once on a small shared machine.
            "SPLITMQ_CLIENTS__HEARTBEAT_TTL_S": "60",
        }
    )
    yield env
    servers = {**env, "SPLITMQ_BROKER": "rabbitmq", "SPLITMQ_STORE": "redis"}
    clear_job(load_settings(EXAMPLE, servers), [f"client-{i}" for i in range(CLIENTS)])


@pytest.mark.rabbitmq
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_the_example_trains_through_rabbitmq_and_redis(
    tmp_path: Path, service_env: dict[str, str]
) -> None:
    runs = tmp_path / "runs"
    command = ["up", str(EXAMPLE.relative_to(REPO)), "--workers", "1", "--clients", str(CLIENTS)]
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", *command, "--report-dir", str(runs)],
        cwd=REPO,
        env=service_env,
        capture_output=True,
        text=True,
        timeout=220,
        check=False,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (run_dir,) = runs.iterdir()
    assert_trained(run_dir)
