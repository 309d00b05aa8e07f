"""`splitmq run CONFIG`: the whole job in this process, on the in-memory broker and store."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import click

from services.cli.common import (
    config_argument,
    json_logs,
    load,
    log_options,
    pick_log_level,
    stop_on_signals,
)
from services.cli.errors import debug_mode
from services.common.backends import Backends, Embedded
from services.common.logs import configured_logging


@click.command()
@config_argument
@click.option(
    "--report-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where run directories go (default: report.dir from the config).",
)
@click.option(
    "--linger",
    type=click.FloatRange(min=0),
    default=0.0,
    help="Keep serving the dashboard and metrics this many seconds after the run ends "
    "(Ctrl-C ends it sooner).",
)
@log_options
def run(
    config: Path | None,
    report_dir: Path | None,
    linger: float,
    log_json: bool,
    log_level: str | None,
) -> None:
    """Run a whole job in this process (no servers needed).

    Every role runs on a thread over the in-memory broker and store; prints one line per
    round and a summary, and writes the run directory. Serves /metrics and the live
    dashboard while it runs (see [metrics]).
    """
    # Imported here, not at the top: every `splitmq` command (the `splitmq check` healthcheck
    # too) imports this module, and these import torch and the models.
    from services.report.filesink import FileSink
    from services.report.rundir import command_line
    from services.report.sinks import EchoSink, TeeSink
    from services.report.summary import banner
    from services.runtime.embedded import force_embedded, load_job_dataset, run_embedded
    from services.runtime.observe import observed

    _, settings = load(config)
    # Progress lines say what happens; role logs below WARNING would drown them.
    level = pick_log_level(settings, log_level, default="WARNING")
    json_lines = json_logs(settings, log_json)
    logs = configured_logging(
        level, json_lines=json_lines, context={"job": settings.job.name}, debug=debug_mode()
    )
    with logs:
        settings = force_embedded(settings, logging.getLogger("splitmq.runtime"))
        dataset = load_job_dataset(settings)  # a DataError is one line (services.cli.errors)
        sink = FileSink.create(settings, command=command_line(), base_dir=report_dir)
        click.echo(banner(sink.info))
        click.echo(f"run directory: {sink.run_dir}")
        echo = EchoSink(click.echo, rounds=settings.job.rounds)
        stop = threading.Event()
        backends = Backends(settings.broker, settings.store, Embedded())
        watch = observed(
            settings,
            "run",
            backends,
            echo=click.echo,
            dashboard=settings.metrics.dashboard,
            watch=True,
            run_dir=sink.run_dir,
        )
        with stop_on_signals(stop), watch as seen:
            try:
                outcome = run_embedded(
                    settings,
                    sink=TeeSink([sink, echo]),
                    stop=stop,
                    dataset=dataset,
                    backends=seen.backends,
                )
            except Exception:
                # The error boundary says what went wrong: one line for a user's mistake
                # (an unknown model), the traceback for a bug.
                click.echo(f"report: {sink.run_dir}")
                raise
            lingering = linger > 0 and bool(seen.url)
            if lingering:
                click.echo("")
                click.echo(sink.summary, nl=False)
                click.echo(f"serving {seen.url}/ for {linger:g} s more (Ctrl-C to stop)")
                # The run set `stop` when it ended; Ctrl-C now ends the wait.
                rest = threading.Event()
                with stop_on_signals(rest):
                    rest.wait(linger)
    if not lingering:
        click.echo("")
        click.echo(sink.summary, nl=False)
    if outcome.traceback:
        click.echo(f"\n{outcome.failed_role} failed:\n{outcome.traceback}", err=True)
    if outcome.stuck:
        click.echo(f"roles that did not stop in time: {', '.join(outcome.stuck)}", err=True)
    if outcome.exit_code:
        raise click.exceptions.Exit(outcome.exit_code)
