"""`splitmq replay RUN_DIR [--check]`: execute a run's recorded schedule again (issue 36)."""

from __future__ import annotations

import logging
from pathlib import Path

import click

from services.cli.common import LogOptions, log_options, stop_on_signals


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--check",
    is_flag=True,
    help="Compare the model the replay reaches with the run's model.safetensors and print "
    "the largest difference per tensor; exit 1 unless they are bit-identical.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    help="Where the replay writes its model and record (default RUN_DIR/replay, replaced).",
)
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    envvar="SPLITMQ_DATA_DIR",
    help="Where the full datasets are on this machine, in place of the run's data.dir "
    "(default: $SPLITMQ_DATA_DIR, else the run's own).",
)
@log_options
def replay(
    run_dir: Path, check: bool, out: Path | None, data_dir: Path | None, log: LogOptions
) -> None:
    """Replay a run from its config, seed and schedule record, in this process.

    RUN_DIR is a run directory of `splitmq run` or `splitmq up` (it keeps schedule.jsonl.gz).
    The job runs again on the in-memory broker and store with the torch threads the run
    used, and its record is held against the run's: every shard's batch order, the weights
    at their checkpoints and every version's weights. Exit 1 when the replay departs from
    the record (a tampered record, another machine or torch build, a role's nondeterminism),
    saying where; docs/reproducibility.md.
    """
    from services.report.model_diff import diff_report
    from services.report.sinks import EchoSink
    from services.runtime.replay import ReplayError, load_run, replay_run

    try:
        settings, _ = load_run(run_dir, data_dir)
    except ReplayError as exc:
        raise click.ClickException(str(exc)) from None
    # The run's config.toml names its log level; the replay's roles are quiet unless asked.
    quiet = settings.model_copy(update={"log_level": "WARNING"})
    logs = log.logging(quiet, {"job": settings.job.name}, default="WARNING")
    click.echo(f"replaying {run_dir} (job {settings.job.name}, seed {settings.job.seed})")
    with logs, stop_on_signals() as stop:
        try:
            result = replay_run(
                run_dir,
                sink=EchoSink(click.echo, rounds=settings.job.rounds),
                stop=stop,
                check=check,
                out_dir=out,
                data_dir=data_dir,
                log=logging.getLogger("splitmq.replay"),
            )
        except ReplayError as exc:
            raise click.ClickException(str(exc)) from None
    if result.incomplete:
        click.echo(f"note: {result.incomplete}")
    click.echo(f"replay: {result.status}, versions up to {result.versions}; in {result.out_dir}")
    failed = result.status != "finished"
    if result.divergence is None:
        click.echo("record: reproduced (every shard's batch order, checkpoints and versions)")
    else:
        click.echo(f"record: the replay departs from it at {result.divergence}")
        failed = True
    if result.diffs is not None:
        click.echo(f"model: {diff_report(result.diffs)}")
        failed = failed or not result.identical
    if failed:
        raise click.exceptions.Exit(1)
