"""The README's "Next steps" run as written: its bash block, line by line, in one shell.

The block is read from README.md between its `<!-- next-steps -->` markers, so the test and the
README cannot drift apart. It runs in a scratch folder that holds the clone's `.venv` and
`examples/` (links), so what the commands write (run directories, the exported model) lands
there and not in the checkout; the commands themselves are the README's, character for
character. It needs the clone's own `.venv`, which both README set-up commands create.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq, pytest.mark.redis]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- next-steps -->\s*```bash\n(.*?)```\s*<!-- /next-steps -->", re.S)


def next_steps() -> list[str]:
    found = BLOCK.search((ROOT / "README.md").read_text(encoding="utf-8"))
    assert found, "README.md has no <!-- next-steps --> bash block"
    return [line for line in found.group(1).splitlines() if line.strip()]


def test_the_block_is_what_a_new_user_needs() -> None:
    lines = next_steps()
    assert lines[0] == "source .venv/bin/activate"  # splitmq is not on PATH before this
    assert any(line.startswith("splitmq up ") for line in lines)
    assert lines[-1].startswith("splitmq clean ")  # leaves nothing behind in RabbitMQ/Redis


@pytest.mark.timeout(600)
def test_readme_next_steps_run_verbatim(tmp_path: Path, amqp_url: str, redis_url: str) -> None:
    venv = ROOT / ".venv"
    if not (venv / "bin" / "activate").exists():
        pytest.fail(f"{venv} is missing: the README's set-up commands create it in the clone")
    (tmp_path / ".venv").symlink_to(venv)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = "set -euo pipefail\n" + "\n".join(f"echo '+ {line}'\n{line}" for line in next_steps())
    # The examples name 127.0.0.1's RabbitMQ and Redis; the suite's servers may be elsewhere.
    # The job is the README's with fewer, shorter rounds (the suite's time budget): the same
    # commands, the same roles and files, through the documented environment overrides.
    env = {
        **os.environ,
        "SPLITMQ_AMQP_URL": amqp_url,
        "SPLITMQ_REDIS_URL": redis_url,
        "SPLITMQ_JOB__ROUNDS": "2",
        "SPLITMQ_ALGORITHM__MAX_STEPS_PER_ROUND": "10",
    }
    env.pop("SPLITMQ_CONFIG", None)
    done = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "Usage: splitmq" in done.stdout  # --help
    assert re.search(r"all checks passed|passed with \d+ warnings?", done.stdout), output[-3000:]
    (run_dir,) = (tmp_path / "runs" / "service").iterdir()
    assert (run_dir / "metrics.json").exists()
    state = load_file(tmp_path / "model.safetensors")
    assert state and all(name.startswith("blocks.") for name in state)
