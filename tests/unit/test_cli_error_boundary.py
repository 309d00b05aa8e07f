"""User errors are one line in logs and at the CLI boundary; bugs keep their traceback."""

from __future__ import annotations

import io
import logging

import click
from click.testing import CliRunner

from broker.errors import BrokerAuthError, StoreUnavailableError
from services.cli.common import ErrorBoundary, GroupOptions
from services.client.inference import InferenceError
from services.common.logs import configured_logging


def logged(exc: Exception, *, json_lines: bool = False, debug: bool = False) -> str:
    stream = io.StringIO()
    with configured_logging("INFO", stream=stream, json_lines=json_lines, debug=debug):
        try:
            raise exc
        except Exception:
            logging.getLogger("splitmq.worker").exception("worker of job %s died", "j")
    return stream.getvalue()


def test_a_user_error_is_folded_into_its_log_line_with_what_to_do() -> None:
    text = logged(StoreUnavailableError("redis unreachable during heartbeat"))
    assert text.count("\n") == 1
    assert "worker of job j died: redis unreachable during heartbeat -- start Redis" in text


def test_a_user_error_in_json_logs_has_no_traceback() -> None:
    text = logged(BrokerAuthError("refused user 'guest'"), json_lines=True)
    assert text.count("\n") == 1 and "Traceback" not in text and "refused user" in text


def test_a_bug_keeps_its_traceback_and_debug_keeps_every_traceback() -> None:
    assert "Traceback" in logged(KeyError("bug"))
    assert "Traceback" in logged(StoreUnavailableError("down"), debug=True)


def test_pika_error_records_are_dropped_unless_debug() -> None:
    for debug, shown in ((False, False), (True, True)):
        stream = io.StringIO()
        with configured_logging("INFO", stream=stream, debug=debug):
            logging.getLogger("pika.adapters.utils.connection_workflow").error("attempt failed")
        assert ("attempt failed" in stream.getvalue()) is shown


def cli_raising(exc: Exception) -> click.Group:
    @click.group(cls=ErrorBoundary)
    @click.option("--debug", is_flag=True)
    @click.pass_context
    def group(ctx: click.Context, debug: bool) -> None:
        ctx.obj = GroupOptions(debug=debug)

    @group.command()
    def fail() -> None:
        raise exc

    return group


def test_the_boundary_prints_a_user_error_in_one_line() -> None:
    result = CliRunner().invoke(cli_raising(StoreUnavailableError("down")), ["fail"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "Error: down -- start Redis or fix store.redis_url / SPLITMQ_REDIS_URL "
        "(`splitmq doctor` checks it)"
    ]


def test_the_boundary_lets_bugs_and_debug_through() -> None:
    bug = CliRunner().invoke(cli_raising(KeyError("bug")), ["fail"])
    assert isinstance(bug.exception, KeyError)
    debug = CliRunner().invoke(cli_raising(StoreUnavailableError("down")), ["--debug", "fail"])
    assert isinstance(debug.exception, StoreUnavailableError)


def test_an_unanswered_inference_is_one_line() -> None:
    # Worker live at the start but no answer (stopped meanwhile, or busy past --timeout).
    error = InferenceError("job j: no answer to 1 InferRequest(s) after 30 s")
    result = CliRunner().invoke(cli_raising(error), ["fail"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [f"Error: {error}"]
