"""Structured logs: job, client, shard and version on every JSON line, from the thread's
context; --log-format json on the command line."""

from __future__ import annotations

import io
import json
import logging
import threading
from pathlib import Path

from click.testing import CliRunner

from services.cli.main import cli
from services.common.logs import configured_logging, in_log_context, log_context
from services.config.loading import load_settings


def lines_of(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_every_json_line_has_job_client_shard_and_version() -> None:
    stream = io.StringIO()
    log = logging.getLogger("splitmq.test")
    with configured_logging("INFO", json_lines=True, stream=stream, context={"job": "j"}):
        log.info("no context")
        with log_context(shard=2, version=5, client="c-1"):
            log.info("inside")
            with log_context(client=None, round=4):
                log.info("nested")
        log.info("after", extra={"version": 9})
    plain, inside, nested, after = lines_of(stream)
    assert {k: plain[k] for k in ("job", "client", "shard", "version")} == {
        "job": "j",
        "client": None,
        "shard": None,
        "version": None,
    }
    assert (inside["shard"], inside["version"], inside["client"]) == (2, 5, "c-1")
    # None unsets a field for the inner block; others stay.
    assert (nested["shard"], nested["client"], nested["round"]) == (2, None, 4)
    assert after["version"] == 9 and after["shard"] is None


def test_log_context_belongs_to_its_thread() -> None:
    stream = io.StringIO()
    log = logging.getLogger("splitmq.test")
    ready, release = threading.Event(), threading.Event()

    def other() -> None:
        with log_context(shard=1, role="worker"):
            ready.set()
            release.wait(5)
            log.info("worker line")

    with configured_logging("INFO", json_lines=True, stream=stream):
        thread = threading.Thread(target=other)
        thread.start()
        ready.wait(5)
        with log_context(version=3, role="aggregator"):
            log.info("aggregator line")
        release.set()
        thread.join(5)
    by_msg = {line["msg"]: line for line in lines_of(stream)}
    assert by_msg["aggregator line"]["shard"] is None
    assert by_msg["aggregator line"]["version"] == 3
    assert by_msg["worker line"]["shard"] == 1
    assert by_msg["worker line"]["version"] is None
    assert by_msg["worker line"]["role"] == "worker"


def test_log_format_option_and_setting(tmp_path: Path) -> None:
    settings = load_settings(None, {"SPLITMQ_LOG_FORMAT": "json"})
    assert settings.log_format == "json"
    out = CliRunner().invoke(cli, ["worker", "--help"]).output
    assert "--log-format [text|json]" in out
    # A role command refuses the embedded broker after parsing the option: it was accepted.
    config = tmp_path / "c.toml"
    config.write_text('[job]\nname = "j"\n')
    result = CliRunner().invoke(cli, ["coordinator", str(config), "--log-format", "json"])
    assert result.exit_code != 0
    assert "needs a shared broker and store" in result.output


def test_in_log_context_runs_the_act_inside_the_context() -> None:
    stream = io.StringIO()
    log = logging.getLogger("splitmq.test")

    def act(text: str, *, level: int) -> None:
        log.log(level, text)

    with configured_logging("INFO", json_lines=True, stream=stream, context={"job": "j"}):
        in_log_context({"shard": 3, "client": "c-2"}, act, "inside", level=logging.INFO)
        log.info("after")
    inside, after = lines_of(stream)
    assert (inside["msg"], inside["shard"], inside["client"]) == ("inside", 3, "c-2")
    assert after["shard"] is None and after["client"] is None
