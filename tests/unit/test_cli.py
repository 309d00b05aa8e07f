"""`splitmq` command line: help, config errors and exit codes (click's CliRunner)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli

COMMANDS = ("run", "up", "coordinator", "aggregator", "worker", "client", "doctor")
ROLES = ("coordinator", "aggregator", "worker", "client")


def invoke(args: list[str], env: dict[str, str] | None = None) -> tuple[int, str]:
    # A clean SPLITMQ_* environment: the developer's own variables must not leak in.
    base: dict[str, str | None] = {"SPLITMQ_CONFIG": None, "SPLITMQ_BROKER": None}
    base |= {"SPLITMQ_STORE": None, "SPLITMQ_AMQP_URL": None, "SPLITMQ_REDIS_URL": None}
    result = CliRunner().invoke(cli, args, env={**base, **(env or {})}, prog_name="splitmq")
    return result.exit_code, result.output


@pytest.fixture
def memory_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "clitest"\n[clients]\ncount = 2\n')
    return path


def test_help_lists_every_command_with_a_description() -> None:
    code, out = invoke(["--help"])
    assert code == 0
    listing = out.split("Commands:")[1]
    for name in COMMANDS:
        line = next(ln for ln in listing.splitlines() if ln.strip().startswith(name + " "))
        assert len(line.split(None, 1)[1]) > 10, line


@pytest.mark.parametrize("command", COMMANDS[:-1])
def test_each_command_has_help_naming_config(command: str) -> None:
    code, out = invoke([command, "--help"])
    assert code == 0
    assert "[CONFIG]" in out and "--log-json" in out


@pytest.mark.parametrize("command", ["run", "up", *ROLES])
def test_missing_config_file_is_a_clear_error(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    code, out = invoke([command, str(missing)])
    assert code == 1
    assert f"config file not found: {missing}" in out


def test_no_config_at_all_is_a_usage_error() -> None:
    code, out = invoke(["run"])
    assert code == 2
    assert "no configuration: pass CONFIG" in out and "SPLITMQ_CONFIG" in out


def test_invalid_settings_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[algorithm]\nname = 'sgd'\n")
    code, out = invoke(["run", str(path)])
    assert code == 1
    assert "algorithm.name" in out


def test_broken_toml_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("[job\n")
    code, out = invoke(["worker", str(path)])
    assert code == 1
    assert "is not valid TOML" in out


@pytest.mark.parametrize("role", ROLES)
def test_role_commands_refuse_the_in_memory_broker(role: str, memory_config: Path) -> None:
    code, out = invoke([role, str(memory_config)])
    assert code == 1
    assert f"`splitmq {role}` runs as its own process" in out
    assert "SPLITMQ_BROKER=rabbitmq SPLITMQ_STORE=redis" in out


def test_config_comes_from_the_environment_too(memory_config: Path) -> None:
    code, out = invoke(["client"], env={"SPLITMQ_CONFIG": str(memory_config)})
    assert code == 1
    assert "store.kind = 'memory'" in out  # it read the file: the error is about its content


def test_global_config_option_still_works(memory_config: Path) -> None:
    code, out = invoke(["--config", str(memory_config), "coordinator"])
    assert code == 1
    assert "`splitmq coordinator` runs as its own process" in out


@pytest.mark.slow
def test_up_says_plainly_what_is_missing(memory_config: Path) -> None:
    env = {
        "SPLITMQ_AMQP_URL": "amqp://guest:secret@127.0.0.1:1/%2F",
        "SPLITMQ_REDIS_URL": "redis://127.0.0.1:1/0",
        "SPLITMQ_BROKER__RECONNECT_GIVE_UP_S": "1",
        "SPLITMQ_STORE__SOCKET_TIMEOUT_S": "1",
    }
    code, out = invoke(["up", str(memory_config)], env=env)
    assert code == 1
    assert "splitmq up needs RabbitMQ and Redis" in out
    assert "cannot reach RabbitMQ at amqp://guest:***@127.0.0.1:1/%2F" in out
    assert "cannot use Redis at redis://127.0.0.1:1/0" in out
    assert "secret" not in out
