"""`splitmq experiment feddeper --quick`: FedAvg and FedDeper run end to end through the
embedded service on the full Fashion-MNIST, and the section shows what the runs recorded.

The personalised numbers must come from where the docs say: FedDeper's from the clients' v_k
(the mean of the per-client `personal_accuracy.<client>` columns), FedAvg's from the
aggregator's evaluation of the global model (no per-client columns).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.experiments import feddeper
from services.experiments.runner import slug

pytestmark = pytest.mark.slow

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PER_CLIENT = "personal_accuracy."


def last_record(run_dir: Path) -> dict[str, Any]:
    doc = json.loads((run_dir / "metrics.json").read_text())
    assert doc["run"]["status"] == "finished"
    record: dict[str, Any] = doc["records"][-1]
    return record


def row_cells(section: str, title: str) -> list[str]:
    """The `n = 10` row of the table whose caption starts with `title`."""
    table = section.split(f"**{title}")[1]
    row = next(ln for ln in table.splitlines() if ln.startswith("| 10 |"))
    return [c.strip() for c in row.strip("|").split("|")]


def test_quick_feddeper_reports_global_and_personalised_accuracy(
    tmp_path: Path, data_dir: str
) -> None:
    out = tmp_path / "docs" / "results.md"
    runs_dir = tmp_path / "runs"
    args = ["experiment", feddeper.NAME, "--quick", "--data-dir", data_dir]
    args += ["--out", str(out), "--runs-dir", str(runs_dir)]
    result = CliRunner().invoke(cli, args, env={"SPLITMQ_DATA_DIR": None})
    assert result.exit_code == 0, result.output

    quick_runs = feddeper.build().quick_runs
    last = {
        run.tags["method"]: last_record(runs_dir / feddeper.NAME / slug(run.label))
        for run in quick_runs
    }
    fedavg, deper = last[feddeper.FEDAVG], last[feddeper.feddeper_label("0.1")]

    # FedDeper: the personalised accuracy is the clients' v_k, one column per participant.
    per_client = [v for k, v in deper["extra"].items() if k.startswith(PER_CLIENT)]
    assert len(per_client) == 10  # n = 10, every client in every round
    assert deper["personal_accuracy"] == pytest.approx(sum(per_client) / len(per_client))
    assert feddeper.GLOBAL_ON_LOCAL in deper["extra"]
    # Six steps on two classes already beat the 50 % of guessing between them.
    assert deper["personal_accuracy"] > 0.6
    # FedAvg: no personal model, so no per-client columns; the aggregator's number.
    assert not any(k.startswith(PER_CLIENT) for k in fedavg["extra"])

    text = out.read_text()
    section = text.split("<!-- feddeper -->")[1].split("<!-- /feddeper -->")[0]
    assert "Smoke run" in section and "2210.03444" in section
    methods = [feddeper.FEDAVG, feddeper.feddeper_label("0.1")]
    final = row_cells(section, "Final global")
    assert final[1:3] == [f"{100 * last[m]['global_accuracy']:.1f}" for m in methods]
    personal = row_cells(section, "Final personalised")
    assert personal[1:3] == [f"{100 * last[m]['personal_accuracy']:.1f}" for m in methods]
    gain = 100 * (deper["personal_accuracy"] - fedavg["personal_accuracy"])
    assert personal[4] == f"{gain:+.1f}"

    for run in quick_runs:
        assert re.search(rf"\| `{re.escape(run.label)}` \|.*\| finished \| 2/2 \|", section)
    figures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", section)
    assert len(figures) == 2, section
    for relative in figures:
        assert (out.parent / relative).read_bytes()[:8] == PNG_MAGIC
