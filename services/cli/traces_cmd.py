"""`splitmq traces generate|show`: availability traces for the client host (docs/traces.md).

No CONFIG: a trace is a file of its own, made and read without a job.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from services.client.trace_model import DAY_S, DiurnalModel, generate
from services.client.traces import Trace, TraceStats

F = TypeVar("F", bound=Callable[..., Any])

_DEFAULTS = DiurnalModel()
_BAR = 40  # characters of a full bar in `show`
# `generate`'s model options: flag, DiurnalModel field, help.
_MODEL = (
    ("--peak", "peak_fraction", "Online fraction at the peak of the day."),
    ("--trough", "trough_fraction", "Online fraction at the trough."),
    ("--peak-hour", "peak_hour", "Local hour of the peak."),
    ("--session-median-s", "session_median_s", "Median session, in seconds of a 24 h day."),
    ("--session-sigma", "session_sigma", "Sigma of the lognormal session length's log."),
    ("--tz-spread-h", "tz_spread_h", "Time zones: uniform over this many hours."),
)


def _model_options(command: F) -> F:
    for flag, name, text in reversed(_MODEL):
        default = getattr(_DEFAULTS, name)
        command = click.option(
            flag, name, type=float, default=default, show_default=True, help=text
        )(command)
    return command


@click.group()
def traces() -> None:
    """Make and inspect availability traces (CSV: client,online_from_s,online_to_s)."""


@traces.command("generate")
@click.option("--clients", type=click.IntRange(min=1), required=True, help="How many devices.")
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    required=True,
    help="Seconds the trace covers (of the run, after --day-s).",
)
@click.option(
    "--day-s",
    type=click.FloatRange(min=0, min_open=True),
    default=DAY_S,
    show_default=True,
    help="Seconds one model day lasts: 300 replays a day (sessions included) in 5 minutes.",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--out",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Where the CSV goes (default: standard output).",
)
@_model_options
def generate_cmd(
    clients: int,
    duration: float,
    day_s: float,
    seed: int,
    out: Path | None,
    **params: Any,
) -> None:
    """A seeded trace of diurnal availability with lognormal sessions (docs/traces.md)."""
    try:
        model = DiurnalModel(**params)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    trace = generate(model, clients, duration, day_s=day_s, seed=seed)
    if out is None:
        click.echo(trace.to_csv(), nl=False)
        return
    trace.save(out)
    stats = trace.stats(buckets=1)
    click.echo(f"{out}: {stats.clients} clients, {stats.sessions} sessions", err=True)


@traces.command("show")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--buckets", type=click.IntRange(min=1), default=24, show_default=True)
@click.option(
    "--end",
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds to summarise (default: the trace's last finite time).",
)
@click.option(
    "--plot",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also draw the online fraction per bucket into this PNG.",
)
def show(file: Path, buckets: int, end: float | None, plot: Path | None) -> None:
    """Summarise a trace: clients, sessions, online fraction by time bucket."""
    trace = Trace.load(file)
    stats = trace.stats(buckets, end)
    click.echo(f"clients:  {stats.clients}")
    click.echo(f"sessions: {stats.sessions} ({stats.sessions_per_client:.1f} per client)")
    click.echo(
        f"session length: mean {_seconds(stats.mean_session_s)}, "
        f"median {_seconds(stats.median_session_s)} (finite sessions)"
    )
    if not stats.online_fraction:
        click.echo("online fraction: no finite time to bucket")
        return
    click.echo(f"online fraction by {_seconds(stats.bucket_s)} bucket (start s, fraction):")
    for i, fraction in enumerate(stats.online_fraction):
        bar = "#" * round(fraction * _BAR)
        click.echo(f"  {i * stats.bucket_s:>9.0f} {fraction:6.1%} {bar}")
    if plot is not None:
        _plot(plot, file.name, stats)
        click.echo(f"plot: {plot}")


def _plot(path: Path, name: str, stats: TraceStats) -> None:
    from services.report.plots import panel_figure  # matplotlib: only when asked

    hours = stats.bucket_s / 3_600.0
    edges = [i * hours for i in range(len(stats.online_fraction) + 1)]
    percent = [100 * f for f in stats.online_fraction]

    def draw(axes: Any, _: str) -> bool:
        axes.stairs(percent, edges, baseline=None, label=name)
        axes.set_xlabel("hours from the start")
        axes.set_ylim(bottom=0)
        return True

    panel_figure(path, f"{stats.clients} clients", [""], draw, ylabel="online (%)")


def _seconds(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value / 3_600:.2f} h" if value >= 3_600 else f"{value:.0f} s"
