"""`splitmq check`, `splitmq --help` and a role that cannot start must not import torch.

`splitmq check ROLE` is the containers' healthcheck, a fresh process every few seconds; torch
alone takes seconds of CPU to import, so the CLI imports it (and the roles, models and report
that pull it in) only inside the commands that run a role. Each case runs the real console
entry point in a fresh interpreter and reads back what it imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Runs `splitmq ARGS...` through the console script's entry point, then prints a marker line
# naming the heavy modules that ended up imported.
ENTRY = """
import sys
from services.cli.main import main
sys.argv = ["splitmq", *sys.argv[1:]]
try:
    main()
except SystemExit:
    pass
print("HEAVY:" + ",".join(m for m in ("torch",) if m in sys.modules))
"""

# Nothing listens on port 1: the store is refused at once, after the store code has run.
UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"


def splitmq(args: list[str], env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """The command's output (without the marker) and the heavy modules it imported."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SPLITMQ_")}
    proc = subprocess.run(
        [sys.executable, "-c", ENTRY, *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    out = proc.stdout
    marker = out.rfind("HEAVY:")
    assert marker >= 0, f"the entry point did not finish: {proc.stdout}{proc.stderr}"
    heavy = out[marker + len("HEAVY:") :].strip()
    return out[:marker] + proc.stderr, [m for m in heavy.split(",") if m]


@pytest.fixture
def redis_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        '[job]\nname = "imports"\n[broker]\nkind = "rabbitmq"\n'
        f'[store]\nkind = "redis"\nredis_url = "{UNREACHABLE_REDIS}"\n'
    )
    return path


@pytest.mark.parametrize("args", [["--help"], ["check", "--help"], ["worker", "--help"]])
def test_help_does_not_import_torch(args: list[str]) -> None:
    out, heavy = splitmq(args)
    assert "Usage: splitmq" in out
    assert heavy == []


@pytest.mark.parametrize("role", ["worker", "coordinator", "aggregator", "autoscaler"])
def test_check_of_a_role_opens_the_store_without_importing_torch(
    redis_config: Path, role: str
) -> None:
    out, heavy = splitmq(["--config", str(redis_config), "check", role])
    # The verdict proves the check went as far as asking the store for its members.
    assert out.startswith(f"unhealthy: store unreachable, cannot see the {role}: "), out
    assert heavy == []


def test_check_of_the_store_and_a_client_do_not_import_torch(redis_config: Path) -> None:
    out, heavy = splitmq(["--config", str(redis_config), "check", "store"])
    assert out.startswith("unhealthy: cannot use Redis at redis://127.0.0.1:1/0"), out
    assert heavy == []
    out, heavy = splitmq(["--config", str(redis_config), "check", "client", "--id", "nobody"])
    assert out.strip() == "unhealthy: no live client named nobody in job imports"
    assert heavy == []


# The aggregator is not among them: it opens its run directory first, so that the report
# records the failure, and the run's description names the algorithm and torch's version.
@pytest.mark.parametrize("role", ["coordinator", "worker", "client"])
def test_a_role_that_cannot_start_says_so_before_importing_torch(tmp_path: Path, role: str) -> None:
    # A wrong URL is the user's mistake: one line at once, not after seconds of imports.
    config = tmp_path / "job.toml"
    config.write_text(
        '[job]\nname = "imports"\n[broker]\nkind = "rabbitmq"\n[store]\nkind = "redis"\n'
    )
    out, heavy = splitmq([role, str(config)], env={"SPLITMQ_AMQP_URL": "http://127.0.0.1:5672/"})
    assert "could not start: the RabbitMQ URL must start with amqp:// or amqps://" in out, out
    assert heavy == []


def test_the_marker_sees_torch_when_a_command_needs_it(tmp_path: Path) -> None:
    # Guards the test itself: the same entry point does report torch when a command loads it
    # (`doctor` reports the torch version), so an empty list above is not a blind spot.
    config = tmp_path / "job.toml"
    config.write_text('[job]\nname = "imports"\n')
    out, heavy = splitmq(["--config", str(config), "doctor"])
    assert "torch" in out and heavy == ["torch"]
