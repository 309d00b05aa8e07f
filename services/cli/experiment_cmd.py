"""`splitmq experiment NAME`: run an experiment's grid and write its section of the results."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

import click

from services.cli.common import stated_command, stop_on_signals
from services.common.logs import configured_logging
from services.config.loading import ConfigError
from services.data.errors import DataError
from services.experiments.registry import NAMES, get_experiment

DEFAULT_OUT = Path("docs/results.md")
# A smoke run must not replace real results unless asked to.
QUICK_OUT = Path("runs/experiments/results-quick.md")


@click.command()
@click.argument("name", type=click.Choice(sorted(NAMES)))
# In the order the command stated with the results names them (`_command`).
@click.option("--quick", is_flag=True, help="Smoke size: a tiny grid, a few steps.")
@click.option(
    "--paper",
    is_flag=True,
    help="At the paper's own setting (examples/experiments/NAME-paper.toml), into the "
    "section NAME-paper of the results.",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the full datasets are (default: $SPLITMQ_DATA_DIR).",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help=f"Markdown file to write the section to (default {DEFAULT_OUT}; {QUICK_OUT} "
    "with --quick); figures go to results/ beside it.",
)
@click.option(
    "--runs-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("runs/experiments"),
    show_default=True,
    help="Where each run's report directory goes.",
)
@click.option(
    "--reuse",
    is_flag=True,
    help="Read back runs already finished with the same settings (from --runs-dir, or from "
    "results/runs/ beside --out, where every finished run's numbers are kept).",
)
@click.option("--only", default=None, help="Run only the labels matching this glob.")
@click.option(
    "--seeds",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Run each configuration with this many seeds (job.seed, +1, ...); tables then show "
    "mean ± std, plots a band.",
)
@click.option(
    "--torch-threads",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="torch intra-op threads of this process (the roles already run on many threads).",
)
@click.option(
    "--client-slots",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="A run's clients training whole models at once (0: one per core). Two experiment "
    "processes side by side go faster with 1 each: threads of one process share its GIL.",
)
def experiment(
    name: str,
    data_dir: Path | None,
    quick: bool,
    paper: bool,
    out: Path | None,
    runs_dir: Path,
    reuse: bool,
    only: str | None,
    seeds: int,
    torch_threads: int,
    client_slots: int,
) -> None:
    """Run the experiment NAME and write its tables and plots.

    Every run goes through the embedded service in this process (or the in-process
    centralized loop); progress is printed per round. The section NAME of the results file
    is replaced; the rest of the file is kept.
    """
    from services.experiments.document import FIGURES_DIR, Context, write_results
    from services.experiments.runner import run_experiment

    if quick and paper:
        raise click.UsageError("--quick and --paper exclude each other (smoke size or the paper's)")
    target = out or (QUICK_OUT if quick else DEFAULT_OUT)
    # Each role of a run is a thread that calls torch: intra-op threads on top of them
    # oversubscribe the cores and spin at barriers waiting for each other. This is the
    # process's edge: the setting is for the whole command.
    import torch

    torch.set_num_threads(torch_threads)
    command = _command(click.get_current_context())
    with configured_logging("WARNING"), stop_on_signals() as stop:
        try:
            spec = get_experiment(name)
            spec = spec.at_paper() if paper else spec
            results = run_experiment(
                spec,
                runs_dir=runs_dir,
                quick=quick,
                data_dir=str(data_dir) if data_dir else None,
                reuse=reuse,
                command=command,
                echo=click.echo,
                stop=stop,
                only=(lambda run: fnmatch.fnmatch(run.label, only)) if only else None,
                seeds=seeds,
                client_slots=client_slots,
                # Kept beside the figures, so a long grid can be run in parts (`--reuse`).
                archive=None if quick else target.parent / FIGURES_DIR / "runs",
            )
        except (ConfigError, DataError, FileNotFoundError) as exc:
            raise click.ClickException(str(exc)) from None
    if stop.is_set():
        click.echo(
            f"stopped after {len(results.runs)} runs; {target} left unchanged "
            "(rerun with --reuse to continue)",
            err=True,
        )
        raise click.exceptions.Exit(130)
    write_results(spec, results, Context(command, quick, _data_source(data_dir)), target)
    click.echo(f"wrote section {spec.name!r} of {target}")
    failed = [r.label for r in results if not r.complete]
    if failed:
        click.echo(f"runs that did not finish: {', '.join(failed)}", err=True)
        raise click.exceptions.Exit(1)


def _data_source(data_dir: Path | None) -> str:
    """Where the datasets came from, in words that hold on any machine."""
    if data_dir is not None:
        return "--data-dir"
    return "$SPLITMQ_DATA_DIR" if os.environ.get("SPLITMQ_DATA_DIR") else "the shipped sample"


def _command(ctx: click.Context) -> str:
    """--reuse and --runs-dir are left out: a reused run is a run of the very same settings."""
    return stated_command(ctx, ctx.params["name"], skip=("reuse", "runs_dir"))
