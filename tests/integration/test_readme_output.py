"""The README's quick-start output is a real run, and stays one: its per-round accuracies and
losses are what `splitmq run examples/quickstart.toml` prints today (a deterministic run gives
the same ones on every run of this machine's kind, issue 36; timings are not compared)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

ROOT = Path(__file__).resolve().parents[2]
ROUND = re.compile(r"^round (\d+)/\d+\s+v\d+\s+global\s+([\d.]+)%.*?loss ([\d.]+)", re.MULTILINE)


def test_the_readme_shows_what_the_quick_start_trains(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("```console\n", 1)[1].split("```", 1)[0]
    shown = [(int(r), a, loss) for r, a, loss in ROUND.findall(block)]
    assert len(shown) == 4, block

    args = ["run", str(ROOT / "examples/quickstart.toml"), "--report-dir", str(tmp_path)]
    env = {"SPLITMQ_METRICS__ENABLED": "false", "SPLITMQ_REPORT__PLOTS": "false"}
    result = CliRunner().invoke(cli, args, env={**env, "SPLITMQ_CONFIG": None})
    assert result.exit_code == 0, result.output
    (run_dir,) = tmp_path.iterdir()
    records = json.loads((run_dir / "metrics.json").read_text())["records"]
    ran = [
        (r["round"], f"{100 * r['global_accuracy']:.1f}", f"{r['train_loss']:.3f}") for r in records
    ]
    assert ran == shown, "README.md's quick-start output is not what the run trains now"
