"""`splitmq run CONFIG`: the whole job in this process, on the in-memory broker and store."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from services.cli.common import (
    LogOptions,
    config_argument,
    load,
    log_options,
    report_dir_option,
    run_report,
    stop_on_signals,
)
from services.common.backends import Backends, Embedded


@click.command()
@config_argument
@report_dir_option
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
    log: LogOptions,
) -> None:
    """Run a whole job in this process (no servers needed).

    Every role runs on a thread over the in-memory broker and store; prints one line per
    round and a summary, and writes the run directory. Serves /metrics and the live
    dashboard while it runs (see [metrics]).
    """
    from services.runtime.embedded import force_embedded, run_embedded
    from services.runtime.observe import observed
    from services.runtime.roles import load_job_dataset

    _, settings = load(config)
    # Progress lines say what happens; role logs below WARNING would drown them.
    with log.logging(settings, {"job": settings.job.name}, default="WARNING"):
        settings = force_embedded(settings, logging.getLogger("splitmq.runtime"))
        dataset = load_job_dataset(settings)  # a DataError is one line (services.cli.common)
        sink, both = run_report(settings, report_dir)
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
        with stop_on_signals() as stop, watch as seen:
            try:
                outcome = run_embedded(
                    settings,
                    sink=both,
                    stop=stop,
                    dataset=dataset,
                    backends=seen.backends,
                )
            except Exception:
                # The error boundary says what went wrong: one line for a user's mistake
                # (an unknown model), the traceback for a bug.
                click.echo(f"report: {sink.run_dir}")
                raise
            click.echo("")
            click.echo(sink.summary, nl=False)
            if linger > 0 and seen.url:
                click.echo(f"serving {seen.url}/ for {linger:g} s more (Ctrl-C to stop)")
                # The run set `stop` when it ended; Ctrl-C now ends the wait.
                with stop_on_signals() as rest:
                    rest.wait(linger)
    if outcome.traceback:
        click.echo(f"\n{outcome.failed_role} failed:\n{outcome.traceback}", err=True)
    if outcome.stuck:
        click.echo(f"roles that did not stop in time: {', '.join(outcome.stuck)}", err=True)
    if outcome.exit_code:
        raise click.exceptions.Exit(outcome.exit_code)
