"""docs/results.md: one section per experiment between `<!-- name -->` markers.

Each `splitmq experiment NAME` rewrites only its own section (and its figures under
`results/` beside the file), so experiments never clobber each other or hand-written text
outside the markers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from services.config.root import Settings
from services.experiments.experiment import Experiment
from services.experiments.figures import FigureSlot, write_figure
from services.experiments.results import ResultSet
from services.experiments.runner import build_settings
from services.experiments.tables import render_table, runs_table

RESULTS_HEADER = (
    "# Results\n\n"
    "Experiments reproducing the seed papers' claims on SplitMQ. Every section is written by\n"
    "`splitmq experiment NAME` (command, machine and wall times inside it); edit the experiment\n"
    "modules in `services/experiments/`, not the numbers.\n"
)
FIGURES_DIR = "results"


def sizes_line(settings: Settings) -> str:
    """The training budget of a run, in the numbers that decide its cost."""
    algorithm, clients = settings.algorithm, settings.clients
    if algorithm.max_steps_per_round:
        local = f"at most {algorithm.max_steps_per_round} local steps"
    else:
        local = f"{algorithm.local_epochs} local epoch(s)"
    tested = settings.data.eval_samples or "all"
    return (
        f"{settings.job.rounds} rounds of {local} (batch {algorithm.batch_size}) per client, "
        f"{clients.count} clients ({clients.fraction:.0%} per round), {settings.data.dataset}, "
        f"evaluation on {tested} test images"
    )


def seeds_line(results: ResultSet) -> str:
    """How many seeds each configuration ran with, and what the numbers are then."""
    counts = sorted({len(r.runs) for r in results})
    if not counts or counts == [1]:
        return (
            "one per configuration (`--seeds N` runs N): a difference of a point or two is "
            "within what another seed could change."
        )
    seeds = sorted({s for r in results for s in r.seeds})
    told = " to ".join(map(str, counts))
    return (
        f"{told} per configuration (job.seed {', '.join(map(str, seeds))}: initial model, "
        "partition, sampling and data order); tables show mean ± sample standard deviation, "
        "curves the mean with a band of ± one standard deviation."
    )


@dataclass(frozen=True)
class Context:
    """How the results were produced, stated in the section."""

    command: str
    quick: bool
    data_source: str = ""  # "--data-dir", "$SPLITMQ_DATA_DIR"...


def render_section(
    experiment: Experiment,
    results: ResultSet,
    context: Context,
    figures: Sequence[str],
    extras: Sequence[str] = (),
) -> str:
    """The section's markdown; `extras` (the experiment's own blocks) follow its tables,
    `figures` (the plots' links) its notes."""
    runs = results.runs
    machines = "; ".join(dict.fromkeys(r.machine for r in runs if r.machine)) or "unknown"
    unrecorded = sum(1 for r in runs if not r.machine)
    if unrecorded:
        machines += f" ({unrecorded} runs ran before their machine line was recorded)"
    total_s = sum(r.wall_s for r in runs)
    reused = sum(1 for r in runs if r.reused)
    data = f" (datasets from `{context.data_source}`)" if context.data_source else ""
    quick = context.quick
    sizes = "; ".join(  # distinct, in run order
        dict.fromkeys(sizes_line(build_settings(experiment, r.run, quick=quick)) for r in results)
    )
    parts = [f"## {experiment.title}"]
    if context.quick:
        parts.append("> **Smoke run (`--quick`)**: tiny sizes, numbers mean nothing.")
    parts += [
        experiment.summary.strip(),
        "**Paper's claim.** " + experiment.claim.strip(),
        "**Scaling.** "
        + experiment.scaling.strip()
        + (f"  \n**Sizes as run.** {sizes}." if sizes else ""),
        f"**Command.** `{context.command}`{data}  \n**Machine.** {machines}  \n"
        f"**Seeds.** {seeds_line(results)}  \n"
        f"**Total wall time.** {total_s / 60:.1f} min for {len(runs)} runs "
        "(the machine was shared: see the load at each run's start below)"
        + (
            f"; {reused} runs were read back (`--reuse`) from an earlier invocation with the "
            "same settings."
            if reused
            else "."
        ),
    ]
    parts += [render_table(table, results) for table in experiment.tables]
    parts += [block.strip() for block in extras if block.strip()]
    verdict = experiment.verdict(results) if experiment.verdict else []
    if verdict:
        parts.append(
            "**Our numbers against the claim.**\n\n" + "\n".join(f"- {v}" for v in verdict)
        )
    if experiment.notes.strip():
        parts.append(experiment.notes.strip())
    parts += figures
    parts.append("**Every run** (wall time per run; report directories under the runs folder)")
    parts.append(runs_table(results.runs))
    return "\n\n".join(parts)


def write_section(name: str, text: str, path: Path) -> None:
    """Replace (or append) the section `name` of `path` with `text`."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{text.strip()}\n{end}\n"
    current = path.read_text(encoding="utf-8") if path.exists() else RESULTS_HEADER
    head, found, rest = current.partition(start)
    if found:
        _, closed, tail = rest.partition(end)
        if not closed:
            raise ValueError(f"{path}: {start} has no closing {end}")
        tail = tail.lstrip("\n")
        updated = head + block + ("\n" + tail if tail else "")
    else:
        updated = current.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(updated, encoding="utf-8")


def write_results(experiment: Experiment, results: ResultSet, context: Context, out: Path) -> None:
    """Figures under `<out's folder>/results/`, then the section in `out`."""
    prefix = f"{experiment.name}-quick-" if context.quick else f"{experiment.name}-"
    slot = FigureSlot(out.parent / FIGURES_DIR, prefix, out.parent)
    figures = [link for plot in experiment.plots if (link := write_figure(plot, results, slot))]
    extras = experiment.extras(results, slot) if experiment.extras else ()
    section = render_section(experiment, results, context, figures, extras)
    write_section(experiment.name, section, out)
