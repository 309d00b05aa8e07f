"""`splitmq privacy CONFIG --quick`: the whole evaluation at smoke size, on the shipped sample."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from services.cli.main import cli

CONFIG = """
[job]
name = "privacy-cli-test"
rounds = 2
[model]
name = "cnn5"
cut = "block1"
[data]
dataset = "fashion_mnist_sample"
[algorithm]
batch_size = 32
lr = 0.05
momentum = 0.9
"""


def test_quick_run_writes_its_json_and_figures(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    out = tmp_path / "out"
    options = "--quick --modes ushaped --noise 1 --gradient-noise 0.01".split()
    result = CliRunner().invoke(cli, ["privacy", str(config), "--out", str(out), *options])
    assert result.exit_code == 0, result.output
    document = json.loads((out / "privacy.json").read_text())
    labels = [case["label"] for case in document["cases"]]
    assert labels == [
        "block1-ushaped",
        "block1-ushaped-noise1",
        "block1-ushaped-gradient_noise0.01",
    ]
    for case in document["cases"]:
        assert len(case["label_auc"]) == 2 and len(case["accuracy"]) == 2
        assert case["reconstruction"]["mse"] > 0
    assert document["binary"]["label_auc"][-1]["cosine"] >= 0.9
    assert document["command"] == f"splitmq privacy {config} --out {out} {' '.join(options)}"
    assert "loadavg_before" in document["machine"]
    assert (out / "privacy_tradeoff.png").stat().st_size > 0
    assert (out / "privacy_recon_binary-block1-ushaped.png").is_file()
    table = (out / "privacy_table.md").read_text().splitlines()
    assert len(table) == 2 + 3 + 1  # header, the three cases, the binary check
    assert table[-1].startswith("| binary-block1-ushaped |")


def test_negative_scales_are_refused(tmp_path: Path) -> None:
    config = tmp_path / "job.toml"
    config.write_text(CONFIG)
    result = CliRunner().invoke(cli, ["privacy", str(config), "--quick", "--noise", "-1"])
    assert result.exit_code != 0
    assert "must be >= 0" in result.output
