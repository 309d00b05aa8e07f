"""Async (FedBuff) against sync rounds on the same job with the same churn; run by hand.

    python -m benchmarks.async_vs_sync [--data-dir DIR] [--write-docs]

One job (cnn5 cut after block1, SFL-V2, 8 clients, Fashion-MNIST from `--data-dir`, default
$SPLITMQ_TEST_DATA_DIR or ../shared/data; `--sample` for the shipped sample) is run embedded
twice: with sync rounds and in async mode. Both see the same churn, counted in client updates
so that it hits both at the same point of the training: six clients start, two more join once
a quarter of the job's updates are in, and two of the first leave at the half. Both train on
about the same number of client updates (sync: `--rounds` rounds of the live clients; async:
versions of K updates each), so the accuracies compare at equal client work, and the wall
times say what waiting for rounds costs.

`--write-docs` rewrites the "measured" section of docs/async.md and the staleness histogram
of the async run, docs/async_staleness.png.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.churn import Churn, churn_roles
from benchmarks.common import command_line, machine_line, write_section
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from services.report.filesink import FileSink
from services.report.plots import STALENESS_PNG
from services.report.records import VersionRecord
from services.report.summary import staleness_histogram
from services.runtime.embedded import run_embedded

DOCS = Path(__file__).resolve().parent.parent / "docs"
SECTION = "async_vs_sync"
CLIENTS = 8
FIRST = 6  # clients there from the start
JOINERS = (6, 7)
LEAVERS = (1, 2)


def default_data_dir() -> str:
    here = Path(__file__).resolve().parent.parent
    return os.environ.get("SPLITMQ_TEST_DATA_DIR", str(here.parent / "shared" / "data"))


def job_settings(args: argparse.Namespace, mode: str) -> Settings:
    versions = args.rounds * FIRST // args.k if mode == "async" else args.rounds
    raw: dict[str, Any] = {
        "job": {"name": f"bench-{mode}", "seed": args.seed, "rounds": versions},
        "model": {"name": "cnn5", "cut": "block1"},
        "data": {
            "dataset": "fashion_mnist_sample" if args.sample else "fashion_mnist",
            "dir": "" if args.sample else args.data_dir,
            "partition": "iid",
            "eval_samples": args.eval_samples,
        },
        "algorithm": {
            "name": "sfl_v2",
            "batch_size": 32,
            "lr": 0.05,
            "momentum": 0.9,
            "max_steps_per_round": args.steps,
        },
        "clients": {"count": CLIENTS, "min_to_start": FIRST, "heartbeat_s": 1.0},
        "rounds": {"mode": mode, "deadline_s": 120.0},
        "asynchronous": {"buffer_size": args.k, "max_staleness": 4, "worker_max_staleness": 4},
        "workers": {"count": 1, "checkpoint_every_steps": 20},
        "report": {"dir": str(args.runs), "plots": True},
    }
    return Settings.model_validate(raw)


@dataclass
class Outcome:
    mode: str
    status: str
    wall_s: float
    records: list[VersionRecord]
    run_dir: Path

    @property
    def updates(self) -> int:
        return sum(r.participants for r in self.records)

    @property
    def final(self) -> float:
        return self.records[-1].global_accuracy if self.records else float("nan")

    @property
    def best(self) -> float:
        return max((r.global_accuracy for r in self.records), default=float("nan"))

    @property
    def last_at(self) -> float:
        """When the last version was published, since the aggregator started."""
        return self.records[-1].elapsed_s if self.records else float("nan")

    def time_to(self, accuracy: float) -> float:
        return next(
            (r.elapsed_s for r in self.records if r.global_accuracy >= accuracy), float("nan")
        )


def run(args: argparse.Namespace, mode: str, dataset: Dataset) -> Outcome:
    settings = job_settings(args, mode)
    total = args.rounds * FIRST  # about the job's client updates, either mode
    sink = FileSink.create(settings, command=f"benchmarks.async_vs_sync ({mode})")

    def updates_at_least(n: int) -> Any:
        return lambda: lambda: sum(r.participants for r in sink.records) >= n

    plan = {i: Churn(join=updates_at_least(total // 4)) for i in JOINERS}
    plan |= {i: Churn(leave=updates_at_least(total // 2)) for i in LEAVERS}
    started = time.monotonic()
    outcome = run_embedded(
        settings,
        sink=sink,
        stop=threading.Event(),
        dataset=dataset,
        build_roles=churn_roles(plan),
        logger=logging.getLogger("bench"),
    )
    wall = time.monotonic() - started
    return Outcome(mode, outcome.status, wall, sink.records, sink.run_dir)


def table(outcomes: list[Outcome], target: float) -> str:
    lines = [
        "| mode | versions | client updates | final accuracy | best | "
        f"time to {100 * target:.0f}% | last version at | wall time | "
        "staleness (folded: count by tau) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for o in outcomes:
        hist = staleness_histogram(o.records)
        stale = "n/a (rounds)" if hist is None else hist.line()
        lines.append(
            f"| {o.mode} | {len(o.records)} | {o.updates} | {100 * o.final:.1f}% | "
            f"{100 * o.best:.1f}% | {o.time_to(target):.0f} s | {o.last_at:.0f} s | "
            f"{o.wall_s:.0f} s | {stale} |"
        )
    return "\n".join(lines)


def accuracy_plot(outcomes: list[Outcome], path: Path) -> None:
    """Test accuracy against wall time, both modes on one figure."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.0), dpi=100)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot(1, 1, 1)
    for o, marker in zip(outcomes, ("o", "s"), strict=False):
        xs = [r.elapsed_s for r in o.records]
        ys = [100 * r.global_accuracy for r in o.records]
        axes.plot(xs, ys, marker=marker, label=f"{o.mode} ({len(o.records)} versions)")
    axes.set_title("Test accuracy over time, same job and churn")
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel("accuracy (%)")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--sample", action="store_true", help="the shipped 6,000-image sample")
    parser.add_argument("--rounds", type=int, default=8, help="sync rounds (async: same work)")
    parser.add_argument("--k", type=int, default=4, help="async buffer size K")
    parser.add_argument("--steps", type=int, default=20, help="local steps per update")
    parser.add_argument("--eval-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--target", type=float, default=0.75, help="accuracy for time-to")
    parser.add_argument("--runs", type=Path, default=Path("runs/async_vs_sync"))
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    data = load_dataset(
        "fashion_mnist_sample" if args.sample else "fashion_mnist",
        None if args.sample else args.data_dir,
    )
    outcomes = [run(args, mode, data) for mode in ("sync", "async")]
    for o in outcomes:
        print(f"{o.mode}: {o.status}, {o.run_dir}")
    machine = machine_line(f"torch {torch.__version__}", f"{args.threads} torch thread(s)")
    text = "\n".join(
        [
            f"Command: `{command_line('benchmarks.async_vs_sync')}`",
            "",
            f"Machine: {machine}",
            "",
            table(outcomes, args.target),
        ]
    )
    print(text)
    if args.write_docs:
        write_section(SECTION, text, DOCS / "async.md")
        shutil.copyfile(outcomes[1].run_dir / STALENESS_PNG, DOCS / "async_staleness.png")
        accuracy_plot(outcomes, DOCS / "async_vs_sync.png")


if __name__ == "__main__":
    main()
