"""`splitmq dashboard CONFIG`: the live dashboard of a job, in a process of its own."""

from __future__ import annotations

from pathlib import Path

import click

from services.cli.common import LogOptions, config_argument, load, log_options, stop_on_signals
from services.common.backends import Backends


@click.command()
@config_argument
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="The run directory whose report to show (default: the job's newest under report.dir).",
)
@log_options
def dashboard(config: Path | None, run_dir: Path | None, log: LogOptions) -> None:
    """Serve a job's dashboard (and /metrics) until Ctrl-C.

    Over RabbitMQ and Redis it follows the running job live: members joining and leaving,
    versions, accuracy, throughput, queue depth and workers. With the embedded broker (a
    `splitmq run` that is over) it shows the run directory's final report. The coordinator
    and `splitmq run` serve the same page themselves.
    """
    from services.runtime.observe import observed  # torch: only for this command

    _, settings = load(config)
    if not settings.metrics.enabled:
        raise click.ClickException("metrics.enabled is false in the config: nothing to serve")
    live = settings.broker.kind == "rabbitmq" and settings.store.kind == "redis"
    with log.logging(settings, {"role": "dashboard", "job": settings.job.name}):
        watch = observed(
            settings,
            "dashboard",
            Backends(settings.broker, settings.store),
            echo=click.echo,
            dashboard=True,
            live=live,
            run_dir=run_dir,
        )
        with stop_on_signals() as stop, watch as seen:
            if not seen.url:
                raise click.ClickException("no free port for the dashboard (see [metrics])")
            if not live:
                click.echo("embedded broker and store: showing the run directory's report")
            stop.wait()
