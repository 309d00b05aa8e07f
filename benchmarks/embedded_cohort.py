"""Whole-model cohorts in one process: clients gated one per core vs all at once; by hand.

    python -m benchmarks.embedded_cohort [--data-dir DIR] [--rounds 8] [--reps 2] [--write-docs]

An embedded run (`splitmq run`, `splitmq experiment`) puts every client of a job on a thread
of one process. A whole-model round (Sub-FedAvg, FedAvg, Standalone) waits on nothing, so a
cohort of ten trains on ten threads at once over the machine's cores. This runs the same
Sub-FedAvg job (the paper's local step: MNIST 5-layer CNN, batch 10, lr 0.01, momentum 0.5;
20 clients of two 250-image shards, half of them a round, one local epoch) embedded, with the
clients sharing a `ComputeGate` of one slot per core (what `embedded_roles` builds) and with
no gate, `--reps` times each, alternating. Reported: the median round wall time over rounds
2.. (the first pays for imports and warm-up) and the process's CPU seconds per round.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import resource
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command_line, machine_line, write_section
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink
from services.runtime.embedded import run_embedded
from services.runtime.roles import embedded_roles

SECTION = "embedded_cohort"
CLIENTS = 20


def default_data_dir() -> str:
    here = Path(__file__).resolve().parent.parent
    return os.environ.get("SPLITMQ_DATA_DIR", str(here.parent / "shared" / "data"))


def job_settings(args: argparse.Namespace, name: str) -> Settings:
    raw: dict[str, Any] = {
        "job": {"name": name, "seed": 0, "rounds": args.rounds},
        "model": {"name": "cnn5"},
        "data": {
            "dataset": "mnist",
            "dir": args.data_dir,
            "partition": "shards",
            "shards_per_client": 2,
            "shard_size": 250,
            "eval_samples": 1000,
        },
        "algorithm": {
            "name": "subfedavg",
            "batch_size": 10,
            "local_epochs": 1,
            "lr": 0.01,
            "momentum": 0.5,
            "subfedavg": {"mode": "unstructured", "target": 0.5},
        },
        "clients": {"count": CLIENTS, "min_to_start": CLIENTS, "fraction": 0.5},
        "report": {"plots": False},
    }
    return Settings.model_validate(raw)


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def one_run(args: argparse.Namespace, slots: int | None, rep: int) -> tuple[float, float]:
    """(median round seconds over rounds 2.., CPU seconds per round over rounds 2..)."""
    name = f"cohort-{'gated' if slots is not None else 'open'}-{rep}"
    settings = job_settings(args, name)
    dataset = load_dataset("mnist", args.data_dir)
    sink = ListSink()
    marks: list[tuple[float, float]] = []

    class Marked(ListSink):
        def record(self, record: Any) -> None:
            marks.append((time.perf_counter(), cpu_seconds()))
            sink.record(record)

    outcome = run_embedded(
        settings,
        sink=Marked(),
        stop=threading.Event(),
        dataset=dataset,
        build_roles=functools.partial(embedded_roles, compute_slots=slots),
    )
    if not outcome.ok:
        raise SystemExit(f"{name}: {outcome.status}")
    walls = [b[0] - a[0] for a, b in itertools.pairwise(marks)]
    cpus = [b[1] - a[1] for a, b in itertools.pairwise(marks)]
    return statistics.median(walls), statistics.median(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=default_data_dir())
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # as `splitmq experiment` does: each role is a thread
    cores = os.cpu_count() or 1
    load = os.getloadavg()[0]  # before: the runs themselves load the machine
    results: dict[str, list[tuple[float, float]]] = {"gated": [], "open": []}
    for rep in range(args.reps):
        for label, slots in (("gated", 0), ("open", None)):
            wall, cpu = one_run(args, slots, rep)
            results[label].append((wall, cpu))
            print(f"rep {rep} {label:>5}: {wall:.2f} s a round, {cpu:.2f} CPU s a round")
    gated = statistics.median(w for w, _ in results["gated"])
    open_ = statistics.median(w for w, _ in results["open"])
    gated_cpu = statistics.median(c for _, c in results["gated"])
    open_cpu = statistics.median(c for _, c in results["open"])
    text = f"""
## Embedded cohorts: whole-model clients one per core vs all at once

`{command_line("benchmarks.embedded_cohort")}`

{machine_line(f"load {load:.2f} before")}. Sub-FedAvg (unstructured), MNIST 5-layer CNN,
{CLIENTS} clients of two 250-image shards, 10 a round, one local epoch of batch 10 (500 steps a
round over the cohort), {args.rounds} rounds, medians over rounds 2..{args.rounds} and
{args.reps} runs each, alternating.

| clients training at once | round wall (s) | process CPU per round (s) |
|---|---|---|
| the whole cohort (no gate) | {open_:.2f} | {open_cpu:.2f} |
| one per core ({cores}, `ComputeGate`) | {gated:.2f} | {gated_cpu:.2f} |

Gated / open wall time: **{gated / open_:.2f}x**. Ten threads each stepping a tiny model
hand the GIL back and forth at every op and evict each other's caches; one per core keeps
the cores as busy for less CPU.
"""
    print(text)
    if args.write_docs:
        write_section(SECTION, text)


if __name__ == "__main__":
    main()
