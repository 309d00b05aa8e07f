"""One config form everywhere: `splitmq COMMAND CONFIG` and `splitmq --config FILE COMMAND`,
and doctor's last line (click's CliRunner; the checks themselves are replaced)."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from services.cli import check_cmd
from services.cli.main import cli
from services.common.health import Verdict
from services.config.root import Settings
from services.runtime.doctor import Check, verdict

# Commands whose settings come from a job's config file; the others take none.
NO_CONFIG = {"experiment", "export", "replay", "traces"}  # export, replay: RUN_DIR/config.toml
CLEAN_ENV: dict[str, str | None] = {"SPLITMQ_CONFIG": None, "SPLITMQ_BROKER": None}


def invoke(args: list[str]) -> click.testing.Result:
    return CliRunner().invoke(cli, args, env=CLEAN_ENV, prog_name="splitmq")


@pytest.fixture
def job(tmp_path: Path) -> Path:
    path = tmp_path / "job.toml"
    path.write_text('[job]\nname = "formtest"\n')
    return path


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """The settings doctor and check were given; every check passes."""
    settings: list[Settings] = []

    def fake_checks(given: Settings) -> list[Check]:
        settings.append(given)
        return [Check("torch", True, "fine")]

    def fake_role(given: Settings, role: str, **_: object) -> Verdict:
        settings.append(given)
        return Verdict(True, "fine")

    monkeypatch.setattr(check_cmd, "run_checks", fake_checks)
    monkeypatch.setattr(check_cmd, "check_role", fake_role)
    return settings


@pytest.mark.parametrize(
    "args",
    [
        ["doctor", "{job}"],
        ["--config", "{job}", "doctor"],
        ["check", "worker", "{job}"],
        ["--config", "{job}", "check", "worker"],
    ],
)
def test_doctor_and_check_take_config_both_ways(
    args: list[str], job: Path, seen: list[Settings]
) -> None:
    result = invoke([arg.format(job=job) for arg in args])
    assert result.exit_code == 0, result.output
    assert [settings.job.name for settings in seen] == ["formtest"]


def test_positional_config_wins_over_the_group_option(
    job: Path, tmp_path: Path, seen: list[Settings]
) -> None:
    other = tmp_path / "other.toml"
    other.write_text('[job]\nname = "other"\n')
    assert invoke(["--config", str(other), "doctor", str(job)]).exit_code == 0
    assert seen[0].job.name == "formtest"


def test_doctor_without_config_reads_defaults(seen: list[Settings]) -> None:
    assert invoke(["doctor"]).exit_code == 0
    assert seen[0].job.name == Settings().job.name


@pytest.mark.parametrize("name", sorted(set(cli.commands) - NO_CONFIG))
def test_every_command_takes_config_as_argument_and_says_so(name: str) -> None:
    command = cli.commands[name]
    assert any(
        isinstance(param, click.Argument) and param.name == "config" for param in command.params
    )
    result = invoke([name, "--help"])
    assert result.exit_code == 0
    assert "CONFIG" in result.output.split("\n\n", 1)[0], result.output


def test_example_comments_use_the_positional_form() -> None:
    text = (Path(__file__).parents[2] / "examples" / "service.toml").read_text()
    assert "splitmq doctor examples/service.toml" in text
    assert "doctor --config" not in text


def test_group_help_names_both_forms() -> None:
    out = " ".join(invoke(["--help"]).output.split())
    assert "`splitmq doctor job.toml`" in out and "`splitmq --config job.toml doctor`" in out


def _doctor(monkeypatch: pytest.MonkeyPatch, checks: list[Check]) -> click.testing.Result:
    monkeypatch.setattr(check_cmd, "run_checks", lambda settings: checks)
    return invoke(["doctor"])


def test_doctor_with_a_warning_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    store = Check("store", True, "Redis 7 AOF off", "turn AOF on", warning=True)
    result = _doctor(monkeypatch, [Check("torch", True, "fine"), store])
    assert result.exit_code == 0
    assert "[warn] store" in result.output
    assert result.output.splitlines()[-1] == "passed with 1 warning (see above)"
    assert "all checks passed" not in result.output


def test_doctor_clean_and_failed_verdicts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _doctor(monkeypatch, [Check("torch", True, "fine")]).output.endswith(
        "all checks passed\n"
    )
    failed = _doctor(monkeypatch, [Check("broker", False, "down"), Check("torch", True, "ok")])
    assert failed.exit_code == 1
    assert "Error: 1 check of 2 failed (see above)" in failed.output


def test_verdict_counts_warnings_and_failures() -> None:
    warn = Check("store", True, "x", warning=True)
    assert verdict([warn, warn]) == "passed with 2 warnings (see above)"
    assert verdict([warn, Check("b", False, "x"), Check("c", False, "x")]) == (
        "2 checks of 3 failed, 1 warning (see above)"
    )


def test_command_line_wins_over_splitmq_config(
    job: Path, tmp_path: Path, seen: list[Settings]
) -> None:
    other = tmp_path / "other.toml"
    other.write_text('[job]\nname = "other"\n')
    env = {**CLEAN_ENV, "SPLITMQ_CONFIG": str(other)}
    for args in (["doctor", str(job)], ["--config", str(job), "doctor"], ["doctor"]):
        result = CliRunner().invoke(cli, args, env=env, prog_name="splitmq")
        assert result.exit_code == 0, result.output
    assert [settings.job.name for settings in seen] == ["formtest", "formtest", "other"]


@pytest.mark.parametrize("args", [["doctor", "{missing}"], ["--config", "{missing}", "doctor"]])
def test_a_missing_file_reads_the_same_either_way(
    args: list[str], tmp_path: Path, seen: list[Settings]
) -> None:
    missing = tmp_path / "nope.toml"
    result = invoke([arg.format(missing=missing) for arg in args])
    assert result.exit_code == 1
    assert f"config file not found: {missing}" in result.output and not seen
