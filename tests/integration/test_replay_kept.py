"""A kept paper run, replayed (issue 36): `docs/results/runs/minibatch_sfl/
minibatch_sfl-r0-block1` (the MiniBatch-SFL grid's r = 0, cut block1, seed 0 run behind the
tables of docs/results.md) keeps its config and schedule record; `splitmq replay` must
reproduce every version's weights digest from them, and the replay's metrics must be the kept
ones. Bit for bit on a machine like the one that made it (2 CPU cores, x86_64, torch 2.13.0's
CPU build, one torch thread), which is what CI runs on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

KEPT = (
    Path(__file__).resolve().parents[2] / "docs/results/runs/minibatch_sfl/minibatch_sfl-r0-block1"
)
TRAINING = ("version", "round", "participants", "global_accuracy", "global_loss", "train_loss")


def training(path: Path) -> list[list[object]]:
    records = json.loads(path.read_text())["records"]
    return [[r[k] for k in TRAINING] for r in records]


def test_the_kept_minibatch_sfl_run_replays_bit_for_bit(tmp_path: Path, data_dir: str) -> None:
    out = tmp_path / "replay"
    args = ["replay", str(KEPT), "--out", str(out), "--data-dir", data_dir]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "record: reproduced" in result.output
    assert training(out / "metrics.json") == training(KEPT / "metrics.json")
