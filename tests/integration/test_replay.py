"""`splitmq replay`: a run replayed from its record reaches its model bit for bit; a record with
a batch moved, or cut short, is said to be so (issue 36)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

JOB = """
[job]
name = "{job}"
seed = 3
rounds = 2

[model]
name = "cnn5"
cut = "block1"
num_classes = 10

[data]
dataset = "fashion_mnist_sample"
eval_samples = 200

[algorithm]
name = "sfl_v2"
batch_size = 16
lr = 0.05
max_steps_per_round = 6

[clients]
count = 3

[metrics]
enabled = false

[report]
plots = false
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("replay")
    config = root / "job.toml"
    config.write_text(JOB.format(job="replay-test"))
    args = ["run", str(config), "--report-dir", str(root / "runs")]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    (found,) = (root / "runs").iterdir()
    return found


@pytest.fixture(scope="module")
def free_run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A free-running run (`job.deterministic = false`): its shard served the 3 clients'
    batches in arrival order."""
    root = tmp_path_factory.mktemp("replay-free")
    config = root / "job.toml"
    job = JOB.format(job="replay-free")
    config.write_text(job.replace("rounds = 2\n", "rounds = 2\ndeterministic = false\n"))
    args = ["run", str(config), "--report-dir", str(root / "runs")]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    (found,) = (root / "runs").iterdir()
    return found


def replay(run: Path, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["replay", str(run), *args])
    return result.exit_code, result.output


def rewrite(path: Path, change: object) -> None:
    lines = gzip.open(path, "rt").read().splitlines()
    assert callable(change)
    with gzip.open(path, "wt") as f:
        f.write("\n".join(change(lines)) + "\n")


def test_a_run_replays_to_its_own_model_bit_for_bit(run_dir: Path) -> None:
    code, out = replay(run_dir, "--check")
    assert code == 0, out
    assert "record: reproduced" in out
    assert "model: bit-identical: all" in out
    assert (run_dir / "replay" / "model.safetensors").read_bytes() == (
        run_dir / "model.safetensors"
    ).read_bytes()


def test_a_free_running_run_replays_in_its_recorded_order_bit_for_bit(free_run_dir: Path) -> None:
    code, out = replay(free_run_dir, "--check")
    assert code == 0, out
    assert "record: reproduced" in out
    assert "model: bit-identical" in out


def test_a_moved_batch_is_detected_not_replayed_silently(run_dir: Path, tmp_path: Path) -> None:
    tampered = tmp_path / "tampered"
    tampered.mkdir()
    for name in ("config.toml", "schedule.jsonl.gz", "model.safetensors"):
        (tampered / name).write_bytes((run_dir / name).read_bytes())

    def move_one(lines: list[str]) -> list[str]:
        at = [i for i, line in enumerate(lines) if json.loads(line).get("entry") == "applied"]
        a, b = at[4], at[5]  # two batches of different clients, one after the other
        lines[a], lines[b] = lines[b], lines[a]
        return lines

    rewrite(tampered / "schedule.jsonl.gz", move_one)
    code, out = replay(tampered)
    assert code == 1, out
    # The replay serves the tampered order (it follows the record), so the moved batch shows
    # where the weights part from the digests the run recorded.
    assert "record: the replay departs from it at version 2: weights differ" in out
    assert "shard-0: weights differ at the checkpoint after batch" in out


def test_a_record_cut_short_replays_what_it_has_and_says_so(run_dir: Path, tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.mkdir()
    for name in ("config.toml", "schedule.jsonl.gz"):
        (short / name).write_bytes((run_dir / name).read_bytes())

    def drop_last_version(lines: list[str]) -> list[str]:
        # As if the aggregator died before recording version 3: its entry and the count go.
        docs = [json.loads(line) for line in lines]
        last = max(d["version"] for d in docs if d.get("entry") == "folded")
        kept = [d for d in docs if not (d.get("entry") == "folded" and d["version"] == last)]
        for d in kept:
            if d.get("entry") == "stream" and d["name"] == "aggregator":
                d["entries"] -= 1
            if d.get("entry") == "end":
                d["entries"] -= 1
        return [json.dumps(d) for d in kept]

    rewrite(short / "schedule.jsonl.gz", drop_last_version)
    code, out = replay(short)
    assert code == 0, out
    assert "note: the record ends at version 2 of 3" in out
    assert "record: reproduced" in out


def test_a_directory_without_a_record_is_refused_in_one_line(tmp_path: Path) -> None:
    code, out = replay(tmp_path)
    assert code == 1
    assert "is not a replayable run directory: no config.toml" in out
