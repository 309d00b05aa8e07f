"""Generic datasets end to end.

- `splitmq up` over real RabbitMQ and Redis on a folder of PNG images (three classes, 28x28,
  augmented with crops and flips): every client process reads the folder itself, the worker
  builds the model from the images' shape, and the job finishes with its rounds recorded.
- `splitmq run` on an `.npz` of feature vectors [N, F] with a model factory of our own
  (tests/integration/tabular_model.py), which built-in CNNs could not take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from services.cli.main import cli
from services.config.loading import load_settings
from services.runtime.processes import clear_job

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
CLASSES = ("bottom", "middle", "top")

FOLDER_CONFIG = """
[broker]
kind = "rabbitmq"
amqp_url = "{amqp_url}"

[store]
kind = "redis"
redis_url = "{redis_url}"

[job]
name = "set-by-env"
rounds = 2

[model]
name = "cnn5"
num_classes = 3

[data]
dataset = "image_folder"
path = "{folder}"

[data.augment]
crop_padding = 2
horizontal_flip = true

[algorithm]
name = "sfl_v2"
batch_size = 16
lr = 0.05
momentum = 0.9
max_steps_per_round = 8

[clients]
count = 2
min_to_start = 2
# Five processes import torch at once on a small shared machine: be patient with heartbeats.
heartbeat_ttl_s = 60

[workers]
count = 1

[report]
plots = false
"""


def write_bands(root: Path, per_class: int, rng: np.random.Generator) -> None:
    """Grayscale noise with a bright horizontal band whose height is the class: learnable in
    a few steps, and unchanged in kind by a flip or a small shift."""
    for label, name in enumerate(CLASSES):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 60, size=(28, 28), dtype=np.uint8)
            start = 2 + 9 * (2 - label)
            pixels[start : start + 6] = 230
            Image.fromarray(pixels, mode="L").save(folder / f"{i:03d}.png")


@pytest.mark.rabbitmq
@pytest.mark.redis
@pytest.mark.timeout(300)
def test_splitmq_up_trains_on_a_folder_of_images(
    tmp_path: Path, amqp_url: str, redis_url: str, job: str
) -> None:
    rng = np.random.default_rng(0)
    write_bands(tmp_path / "shapes" / "train", 40, rng)
    write_bands(tmp_path / "shapes" / "test", 10, rng)
    config = tmp_path / "folder.toml"
    text = FOLDER_CONFIG.format(amqp_url=amqp_url, redis_url=redis_url, folder="shapes")
    config.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["SPLITMQ_JOB__NAME"] = job
    env["PYTHONPATH"] = str(REPO)  # this checkout, from another working directory
    runs = tmp_path / "runs"
    up = ["up", str(config), "--report-dir", str(runs), "--timeout", "240"]
    try:
        # A relative data.path: every role process resolves it from its working directory.
        result = subprocess.run(
            [sys.executable, "-m", "services.cli.main", *up],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
            check=False,
        )
    finally:
        clear_job(load_settings(config, {"SPLITMQ_JOB__NAME": job}), ["client-0", "client-1"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    (run_dir,) = runs.iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    assert [r["version"] for r in records] == [2, 3]
    assert all(r["participants"] == 2 and r["samples"] == 120 for r in records)
    assert records[-1]["global_accuracy"] > 0.6, f"3 classes: chance is 1/3, got {records[-1]}"
    assert 'dataset = "image_folder"' in (run_dir / "config.toml").read_text()


NPZ_CONFIG = """
[job]
name = "vectors"
rounds = 3

[model]
name = "tests.integration.tabular_model:mlp"
cut = "block1"
num_classes = 4

[data]
dataset = "npz"
path = "{path}"

[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.1
momentum = 0.9
max_steps_per_round = 10

[clients]
count = 2
min_to_start = 2

[report]
dir = "{runs}"
plots = false
"""


def test_splitmq_run_trains_on_npz_vectors_with_a_model_of_our_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    centres = rng.normal(scale=3.0, size=(4, 10))

    def blobs(n: int) -> tuple[np.ndarray, np.ndarray]:
        y = np.arange(n) % 4
        return (centres[y] + rng.normal(size=(n, 10))).astype(np.float32), y

    (x, y), (xt, yt) = blobs(800), blobs(200)
    np.savez(tmp_path / "vectors.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    config = tmp_path / "vectors.toml"
    config.write_text(NPZ_CONFIG.format(path=tmp_path / "vectors.npz", runs=tmp_path / "runs"))
    monkeypatch.syspath_prepend(str(REPO))
    result = CliRunner().invoke(cli, ["run", str(config)], env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    (run_dir,) = (tmp_path / "runs").iterdir()
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    records = doc["records"]
    assert [r["version"] for r in records] == [2, 3, 4]
    assert records[-1]["global_accuracy"] > 0.8, f"4 classes: chance is 1/4, got {records[-1]}"
