"""`splitmq experiment fedsplitx --quick`: FedSplitX with clients at three depth levels and its
baselines (EXC-level-1 = local-loss SFL at block1, EXC-level-3, all clients at level 3) run end
to end through the embedded service on the full Fashion-MNIST, and the section shows what the
runs recorded: each level's client model and the full model, and the server's FLOPs per
sample, which for a known population are a hand-checkable mix of the per-level costs.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from models.registry import build_model
from services.algorithms.fedsplitx import level_costs
from services.cli.main import cli
from services.experiments import fedsplitx
from services.experiments.runner import slug

# About 20 s of CPU; the timeout is for a machine shared with other work.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_dir(runs_dir: Path, label: str) -> Path:
    return runs_dir / fedsplitx.NAME / slug(label)


def records(path: Path) -> list[dict[str, Any]]:
    doc = json.loads((path / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    found: list[dict[str, Any]] = doc["records"]
    return found


def final(path: Path) -> dict[str, float]:
    loaded: dict[str, float] = json.loads((path / "final.json").read_text())
    return loaded


def table_row(section: str, caption: str, *starts: str) -> list[str]:
    """The cells of the first row of the table under `caption` whose first cells begin with
    `starts`."""
    table = section.split(caption)[1].split("\n\n")[1]
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= len(starts) and all(map(str.startswith, cells, starts)):
            return cells
    raise AssertionError(f"no row {starts} under {caption!r}:\n{table}")


def test_quick_fedsplitx_reports_levels_full_model_and_server_flops(
    tmp_path: Path, data_dir: str
) -> None:
    out = tmp_path / "docs" / "results.md"
    runs_dir = tmp_path / "runs"
    args = ["experiment", fedsplitx.NAME, "--quick", "--data-dir", data_dir]
    args += ["--out", str(out), "--runs-dir", str(runs_dir)]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_DATA_DIR": None})
    assert result.exit_code == 0, result.output

    labels = {run.tags["method"]: run.label for run in fedsplitx.build().quick_runs}
    fed_dir = run_dir(runs_dir, labels[fedsplitx.FEDSPLITX])

    # Clients at every depth level trained together in each round, and each level's client
    # model was evaluated beside the full model.
    for record in records(fed_dir):
        levels = sorted(v for k, v in record["extra"].items() if k.startswith("level.client"))
        assert levels == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # the quick mix 2/2/2, all per round
        for m in (1, 2, 3):
            assert 0.0 <= record["extra"][f"level{m}.client_accuracy"] <= 1.0
    fed_final = final(fed_dir)
    assert fed_final["version"] == 3.0  # the last of 2 rounds, on the whole test set
    assert fed_final[fedsplitx.FULL_ACCURACY] > 0.3  # it learned (chance is 0.1)

    section = out.read_text().split("<!-- fedsplitx -->")[1].split("<!-- /fedsplitx -->")[0]
    assert "Smoke run" in section and fedsplitx.PAPER in section

    # The accuracy table shows the final evaluations the runs wrote.
    accuracy = "**Accuracy of every model"
    row = table_row(section, accuracy, fedsplitx.FEDSPLITX, "6 (levels 1/2/3: 2/2/2)")
    assert row[2].startswith("level-1 client model")
    assert row[4] == f"{100 * fed_final['client_accuracy.block1']:.1f}"
    full = table_row(section, accuracy, fedsplitx.FEDSPLITX, "6 (levels 1/2/3: 2/2/2)", "full")
    exc3 = final(run_dir(runs_dir, labels[fedsplitx.EXC3]))["client_accuracy.block3"]
    exc3_row = table_row(section, accuracy, fedsplitx.EXC3)
    assert exc3_row[1] == "2 (all at level 3)"  # only the level-3 clients take part
    assert exc3_row[4] == f"{100 * exc3:.1f}"
    gain = 100 * fed_final[fedsplitx.FULL_ACCURACY] - float(exc3_row[4])
    assert float(exc3_row[8]) == pytest.approx(gain, abs=0.11)
    assert full[4] == f"{100 * fed_final[fedsplitx.FULL_ACCURACY]:.1f}"

    # Server FLOPs: every client trains the same rows each round, so FedSplitX's mean is the
    # plain mean of the three levels' server costs; local-loss SFL at block1 spends its own.
    costs = level_costs(build_model("cnn5"), fedsplitx.LEVEL_CUTS)
    mixed = sum(c.server_flops for c in costs) / 3
    early = level_costs(build_model("cnn5"), ["block1"])[0].server_flops
    server = "**Server compute**"
    fed_row = table_row(section, server, fedsplitx.FEDSPLITX)
    assert fed_row[2] == f"{mixed:,.0f}"
    assert fed_row[3] == f"{mixed / early:.1%}"
    acc_row = table_row(section, server, fedsplitx.EXC1)
    assert acc_row[2:4] == [f"{early:,}", "100.0%"]

    # Every run has its wall time; every linked figure exists and is a PNG.
    for label in labels.values():
        assert re.search(rf"\| `{re.escape(label)}` \|.*\| finished \| 2/2 \|", section)
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert len(figures) == 2, section
    for relative in figures:
        assert (out.parent / relative).read_bytes()[:8] == PNG_MAGIC
