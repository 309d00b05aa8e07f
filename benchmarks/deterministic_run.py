"""The README's main job, deterministic against free-running: same result, and at what speed.

    python -m benchmarks.deterministic_run [--config examples/quickstart.toml] [--reps 3]
                                           [--write-docs]

`splitmq run CONFIG` at its defaults (`job.deterministic = true`) and with
`SPLITMQ_JOB__DETERMINISTIC=false` (batches served in arrival order), interleaved `--reps`
times each, metrics server off. Per run: the final accuracy, the run's own "samples/s
(median)" and a digest of its model file. A deterministic mode has one digest over its runs;
the section says how many distinct ones each mode had.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import command_line, machine_line, write_section


@dataclass(frozen=True)
class Run:
    accuracy: float
    samples_per_s: float
    model: str  # a digest of model.safetensors


def run_once(config: Path, deterministic: bool) -> Run:
    env = {**os.environ, "SPLITMQ_JOB__DETERMINISTIC": str(deterministic).lower()}
    env["SPLITMQ_METRICS__ENABLED"] = "false"
    with tempfile.TemporaryDirectory() as tmp:
        args = [sys.executable, "-m", "services.cli.main", "run", str(config), "--report-dir", tmp]
        subprocess.run(args, env=env, check=True, capture_output=True, text=True)
        (run_dir,) = Path(tmp).iterdir()
        records = json.loads((run_dir / "metrics.json").read_text())["records"]
        speeds = [r["samples_per_s"] for r in records]
        model = hashlib.sha256((run_dir / "model.safetensors").read_bytes()).hexdigest()[:12]
    return Run(records[-1]["global_accuracy"], statistics.median(speeds), model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=Path("examples/quickstart.toml"))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    runs: dict[bool, list[Run]] = {True: [], False: []}
    for rep in range(args.reps):
        for mode in (True, False):
            run = run_once(args.config, mode)
            runs[mode].append(run)
            name = "deterministic" if mode else "free-running"
            print(
                f"{rep + 1}: {name:<13} {run.accuracy:.2%}  {run.samples_per_s:,.0f} samples/s  "
                f"model {run.model}"
            )
    rows = []
    for mode in (True, False):
        got = runs[mode]
        accuracies = ", ".join(f"{r.accuracy:.1%}" for r in got)
        speed = statistics.median(r.samples_per_s for r in got)
        models = len({r.model for r in got})
        name = "deterministic (default)" if mode else "free-running"
        rows.append(f"| {name} | {accuracies} | {speed:,.0f} | {models} of {len(got)} |")
    ratio = statistics.median(r.samples_per_s for r in runs[True]) / statistics.median(
        r.samples_per_s for r in runs[False]
    )
    text = "\n".join(
        [
            "## Deterministic runs: the same model every time, at what speed (issue 36)",
            "",
            f"`{command_line('benchmarks.deterministic_run')}` on {machine_line()}, load "
            f"{load:.2f} at the start: `splitmq run {args.config}` at its defaults and "
            f"free-running, interleaved, {args.reps} runs each. Accuracy: the last round's "
            "global test accuracy; speed: the median of each run's rounds, then of the runs.",
            "",
            "| mode | final accuracy per run | samples/s (median) | distinct model files |",
            "|---|---|---:|---:|",
            *rows,
            "",
            f"Deterministic / free-running speed: {ratio:.2f}x.",
        ]
    )
    print(text)
    if args.write_docs:
        write_section("deterministic-run", text)


if __name__ == "__main__":
    main()
