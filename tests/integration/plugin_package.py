"""A plugin package of a doc's example, pip-installed into a folder of its own, and `splitmq`
run with that folder importable: what the algorithm and dataset plugin tests share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def doc_example(doc: str, heading: str) -> str:
    """The first Python block after `heading` in docs/`doc`, as the reader would copy it."""
    text = (REPO / "docs" / doc).read_text()
    section = text[text.index(heading) :]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def pip_install(root: Path, module: str, code: str, pyproject: str) -> Path:
    """`module`.py with `code` and `pyproject`, installed into `root`/site (returned)."""
    source = root / "src"
    source.mkdir()
    (source / f"{module}.py").write_text(code)
    (source / "pyproject.toml").write_text(pyproject)
    target = root / "site"
    pip = ["pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    subprocess.run(
        [sys.executable, "-m", *pip, "--target", str(target), str(source)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    assert (target / f"{module}.py").is_file()
    return target


def splitmq(target: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`splitmq ARGS` in a process of its own, the installed folder and this checkout first on
    its path and no SPLITMQ_* variables of the caller's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(REPO)])
    return subprocess.run(
        [sys.executable, "-m", "services.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
