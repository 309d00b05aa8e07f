"""`splitmq export RUN_DIR --out FILE`: a run's trained model as one safetensors file that the
job's model (`services.common.jobmodel.job_model` with the run's config.toml) loads as it is."""

from __future__ import annotations

from pathlib import Path

import click


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The safetensors file to write (the whole model's state_dict).",
)
@click.option(
    "--client",
    help="That client's personalised model (personal/<client>.safetensors) instead of the "
    "global one.",
)
def export(run_dir: Path, out: Path, client: str | None) -> None:
    """Write a run's trained model to one safetensors file.

    RUN_DIR is a run directory of `splitmq run` or `splitmq up`. The file is checked by
    loading it into the job's model, built from RUN_DIR/config.toml; load it with
    `model.load_state_dict(safetensors.torch.load_file(FILE))` (README, "Using the trained
    model").
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    from services.common.jobmodel import job_model
    from services.config.loading import load_settings
    from services.report.final_model import MODEL_FILE, PERSONAL_DIR, write_state
    from services.report.rundir import CONFIG_FILE

    source = run_dir / (MODEL_FILE if client is None else f"{PERSONAL_DIR}/{client}.safetensors")
    if not source.is_file():
        kept = sorted(p.stem for p in (run_dir / PERSONAL_DIR).glob("*.safetensors"))
        hint = f"; personal models: {', '.join(kept)}" if kept and client else ""
        raise click.ClickException(
            f"no trained model at {source} (a run keeps one when it has published a version; "
            f"runs of earlier SplitMQ versions did not){hint}"
        )
    # The run's own settings, not this shell's SPLITMQ_* overrides: the model it trained.
    settings = load_settings(run_dir / CONFIG_FILE, {})
    model = job_model(settings)
    state = load_file(source)
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise click.ClickException(f"{source} does not fit the run's model: {exc}") from None
    with safe_open(source, framework="pt") as f:
        metadata = dict(f.metadata() or {})
    write_state(out, state, metadata)
    version = metadata.get("version", "?")
    click.echo(
        f"wrote {out}: {settings.model.name} ({len(state)} tensors), job {settings.job.name} "
        f"version {version}" + (f", client {client}" if client else "")
    )
