"""`splitmq privacy CONFIG`: train the job's model in-process under a grid of defences and
attack what its client sends (docs/privacy.md)."""

from __future__ import annotations

import os
import platform
import time
from dataclasses import replace
from pathlib import Path

import click

from services.cli.common import comma_floats, load, stated_command
from services.data.errors import DataError

DEFAULT_OUT = Path("runs/privacy")
QUICK_OUT = Path("runs/privacy-quick")


@click.command()
@click.argument("config", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help=f"Directory for privacy.json and the PNGs (default {DEFAULT_OUT}; "
    f"{QUICK_OUT} with --quick).",
)
@click.option(
    "--quick",
    is_flag=True,
    help="Smoke size: 2 rounds of 20 steps, the first cut and value of each list.",
)
@click.option("--cuts", default=None, help="Comma-separated cuts (default: the job's).")
@click.option(
    "--modes",
    type=click.Choice(["both", "ushaped", "plain"]),
    default="both",
    show_default=True,
    help="U-shaped (client tail), plain split, or both.",
)
@click.option("--noise", default="", help="Noise scales on z, e.g. 0.5,1,2.")
@click.option(
    "--clip",
    type=click.FloatRange(min=0),
    default=0.0,
    show_default=True,
    help="Bound on each example's ||z|| before the noise (0: none).",
)
@click.option("--nopeek", default="", help="NoPeek weights, e.g. 0.5,2.")
@click.option(
    "--gradient-noise",
    default="",
    help="Noise scales on the dL/dh a U-shaped client returns, e.g. 0.001,0.01.",
)
@click.option(
    "--binary-class",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="The class of the binary one-vs-rest check of the label attacks.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=None,
    help="Rounds per case (default: the job's).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=None,
    help="Steps per round (default: the job's max_steps_per_round, else 100).",
)
@click.option("--decoder-epochs", type=click.IntRange(min=1), default=3, show_default=True)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the full datasets are (default: the job's, else $SPLITMQ_DATA_DIR).",
)
@click.option("--torch-threads", type=click.IntRange(min=1), default=1, show_default=True)
def privacy(
    config: Path,
    out: Path | None,
    quick: bool,
    cuts: str | None,
    modes: str,
    noise: str,
    clip: float,
    nopeek: str,
    gradient_noise: str,
    binary_class: int,
    rounds: int | None,
    steps: int | None,
    decoder_epochs: int,
    data_dir: Path | None,
    torch_threads: int,
) -> None:
    """Attack the job's split model as an honest-but-curious server would.

    Each case trains the job's model in this process (one client, one server, no broker)
    with its defences, scores Li et al.'s norm and cosine label attacks on the gradients a
    U-shaped client returns every round, then trains a decoder from smashed data back to
    images on the test split and scores it on training images, and measures dCor(x, z).
    A binary one-vs-rest run (undefended, U-shaped) checks the label attacks where they must
    work. The [privacy] section of CONFIG is not used: the grid sets the defences.
    """
    import torch

    from services.common.jobdata import data_request
    from services.data.loaders import load_data
    from services.privacy.inversion import DecoderTraining
    from services.privacy.loop import ClientHooks
    from services.privacy.report import write_report
    from services.privacy.sweep import Budget, Case, binary_task, grid, hooks_for, run_case

    torch.set_num_threads(torch_threads)
    _, settings = load(config)
    target = out or (QUICK_OUT if quick else DEFAULT_OUT)
    cut_list = [c for c in (cuts or settings.model.cut).split(",") if c]
    lists = [comma_floats(text) for text in (noise, nopeek, gradient_noise)]
    if quick:
        cut_list, lists = cut_list[:1], [values[:1] for values in lists]
    budget = Budget(
        rounds=2 if quick else rounds or settings.job.rounds,
        steps_per_round=20 if quick else steps or settings.algorithm.max_steps_per_round or 100,
        decoder=DecoderTraining(epochs=1 if quick else decoder_epochs, width=16 if quick else 32),
        public_samples=500 if quick else 0,
        private_samples=128 if quick else 512,
        dcor_samples=128 if quick else 512,
    )
    mode_list = {"both": [True, False], "ushaped": [True], "plain": [False]}[modes]
    cases = grid(
        cut_list, mode_list, noises=lists[0], clip=clip, nopeeks=lists[1], gradient_noises=lists[2]
    )
    request = replace(data_request(settings), dir=str(data_dir or settings.data.dir))
    try:
        data = load_data(request)
    except DataError as exc:
        raise click.ClickException(str(exc)) from None
    if binary_class >= data.info.num_classes:
        raise click.BadParameter(
            f"{data.info.name} has classes 0..{data.info.num_classes - 1}",
            param_hint="--binary-class",
        )

    def make_hooks(case: Case) -> ClientHooks:
        return hooks_for(case, settings.job.seed)

    load_before = os.getloadavg()
    started = time.perf_counter()
    results = [run_case(settings, data, c, budget, make_hooks, echo=click.echo) for c in cases]
    two_class = settings.model_copy(
        update={"model": settings.model.model_copy(update={"num_classes": 2})}
    )
    binary = run_case(
        two_class,
        binary_task(data, binary_class),
        Case(cut_list[0], True),
        budget,
        make_hooks,
        echo=lambda line: click.echo(f"binary {line}"),
    )
    context = {
        "title": f"{settings.model.name} on {data.info.name}",
        "command": stated_command(click.get_current_context(), str(config)),
        "dataset": data.info.name,
        "model": settings.model.name,
        "train_samples": len(data.train),
        "test_samples": len(data.test),
        "binary_class": binary_class,
        "budget": {
            "rounds": budget.rounds,
            "steps_per_round": budget.steps_per_round,
            "batch_size": settings.algorithm.batch_size,
            "decoder_epochs": budget.decoder.epochs,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "torch_threads": torch_threads,
            "platform": platform.platform(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "seconds": time.perf_counter() - started,
    }
    for path in write_report(target, results, binary, context):
        click.echo(f"wrote {path}")
