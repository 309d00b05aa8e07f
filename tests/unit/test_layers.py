"""The layer rule of CONTRIBUTING.md: `lint-imports` over the contracts in pyproject.toml.

A role importing another role, a role importing the wiring layer, or any package cycle through
the layers breaks a contract, and this test prints which import did it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_follow_the_layers() -> None:
    lint = Path(sys.executable).with_name("lint-imports")
    assert lint.exists(), "import-linter is a dev dependency: pip install -e '.[dev]'"
    done = subprocess.run(
        [str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " 0 broken" in done.stdout
