"""What users run, at its defaults: the README's `splitmq run` and `splitmq up` against the plain
in-process loop and against the best hand-tuned thread setting; run by hand, not a test.

    python -m benchmarks.defaults [--reps 3] [--write-docs]

Per repetition, interleaved (the order rotates from one repetition to the next, so a drift of
the machine's load spreads over every configuration):

- **plain loop**: `benchmarks.sfl_inprocess` on the same data (cnn5 cut after block1, the
  shipped Fashion-MNIST sample, 4 clients, batch 32), at 1 torch thread and at one per core;
  the faster is the loop's figure.
- **`splitmq run examples/quickstart.toml`** and **`splitmq up examples/service.toml`**, exactly
  as the README gives them (plus `--report-dir` in a temporary directory): at their defaults,
  then at each hand-tuned setting (`[runtime] torch_threads` of 1 and of every core, with
  active or passive OpenMP waits). Each figure is the run's own "samples/s (median)".
- **`up` under a competing load**: the default `up` while one single-threaded busy loop
  (`python -c "while True: pass"`, what `stress --cpu 1` does) runs beside it.

The figures are the medians over the repetitions; the table, the verdicts against the targets
(issue 34: run >= 0.95x the loop, up >= 0.85x, each >= 0.95x its best hand-tuned setting, up
under the hog >= 0.5x its quiet speed), the load average at the start and the machine are
printed and, with `--write-docs`, written to the "defaults" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks.common import command_line, machine_line, write_section
from services.config.runtime import usable_cores

ROOT = Path(__file__).resolve().parent.parent
SECTION = "defaults"
TITLE = "## Defaults: `splitmq run` and `splitmq up` as shipped (issue 34)"
SAMPLE_DIR = ROOT / "services" / "data" / "sample"
MEDIAN = re.compile(r"samples/s \(median\)\s+([\d,]+)")
# Variables that tune threads by hand: cleared for the default runs, so the figures are what
# a user gets from a fresh shell.
TUNING = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "SPLITMQ_RUNTIME__TORCH_THREADS")
TARGETS = {"run": 0.95, "up": 0.85}
TUNED_TARGET = 0.95
HOG_TARGET = 0.5
HOG = "while True: pass"
# The analysis under the table: prose about mechanisms, kept beside the script that measures.
NOTES = Path(__file__).with_name("defaults_notes.md")


@dataclass(frozen=True)
class Config:
    label: str  # "run default", "up threads=1 passive", "plain loop"
    kind: str  # "run", "up", "loop"
    env: Mapping[str, str] = field(default_factory=dict)
    hog: bool = False

    @property
    def tuned(self) -> bool:
        return bool(self.env)


def configs(cores: int, hog: bool) -> list[Config]:
    tuned = [
        (f"threads={t}{label}", {"SPLITMQ_RUNTIME__TORCH_THREADS": str(t), **wait})
        for t in sorted({1, cores})
        for label, wait in (("", {}), (" active", {"OMP_WAIT_POLICY": "ACTIVE"}))
    ]
    out = [Config("plain loop", "loop")]
    for kind in ("run", "up"):
        out.append(Config(f"{kind} default", kind))
        # Without OMP_WAIT_POLICY, `up` sets PASSIVE for its children (they share the cores);
        # `run` leaves OpenMP's default (spin a while, then sleep).
        out += [Config(f"{kind} {label}", kind, env) for label, env in tuned]
    if hog:
        out.append(Config("up default, 1-core hog beside it", "up", hog=True))
    return out


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TUNING}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return {**env, **extra}


def splitmq(kind: str, report_dir: Path, env: Mapping[str, str], timeout_s: float) -> float:
    """The README's command for `kind`; the run's own median samples/s."""
    config = "examples/quickstart.toml" if kind == "run" else "examples/service.toml"
    argv = [sys.executable, "-m", "services.cli.main", kind, config]
    done = subprocess.run(
        [*argv, "--report-dir", str(report_dir)],
        cwd=ROOT,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    found = MEDIAN.findall(done.stdout)
    if done.returncode != 0 or not found:
        tail = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"splitmq {kind} failed (exit {done.returncode}):\n{tail}")
    return float(found[-1].replace(",", ""))


def plain_loop(cores: int, steps: int, timeout_s: float) -> dict[int, float]:
    """samples/s of the in-process loop at 1 thread and at one per core."""
    threads = [str(t) for t in sorted({1, cores})]
    argv = [sys.executable, "-m", "benchmarks.sfl_inprocess", "--model", "cnn5"]
    argv += ["--cut", "block1", "--dataset", "fashion_mnist_sample", "--data-dir", str(SAMPLE_DIR)]
    argv += ["--clients", "4", "--batch", "32", "--reps", "1", "--warm", "8"]
    argv += ["--steps", str(steps), "--threads", *threads]
    done = subprocess.run(
        argv, cwd=ROOT, env=clean_env({}), capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise RuntimeError(f"the plain loop failed:\n{(done.stdout + done.stderr)[-3000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {int(r["threads"]): float(r["rate"]) for r in rows}


def measure(config: Config, work: Path, args: argparse.Namespace, cores: int) -> float:
    if config.kind == "loop":
        rates = plain_loop(cores, args.loop_steps, args.timeout)
        print(f"    plain loop by threads: {rates}", file=sys.stderr, flush=True)
        return max(rates.values())
    hog = subprocess.Popen([sys.executable, "-c", HOG]) if config.hog else None
    try:
        return splitmq(config.kind, work, config.env, args.timeout)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def ratio_line(name: str, value: float, base: float, target: float) -> str:
    got = value / base if base else float("nan")
    verdict = "meets" if got >= target else "misses"
    return f"{name}: {got:.2f}x ({verdict} the target {target:.2f}x)"


def report(
    results: Mapping[str, list[float]], order: Sequence[Config], load_before: str, cores: int
) -> str:
    median = {label: statistics.median(values) for label, values in results.items()}
    loop = median["plain loop"]
    lines = [
        "| configuration | samples/s (median over reps) | each rep | x plain loop |",
        "|---|---:|---|---:|",
    ]
    for config in order:
        values = results[config.label]
        each = ", ".join(f"{v:,.0f}" for v in values)
        lines.append(
            f"| {config.label} | {median[config.label]:,.0f} | {each} | "
            f"{median[config.label] / loop:.2f} |"
        )
    verdicts = []
    for kind in ("run", "up"):
        default = median.get(f"{kind} default")
        if default is None:
            continue
        verdicts.append(ratio_line(f"`{kind}` default / plain loop", default, loop, TARGETS[kind]))
        tuned = [c.label for c in order if c.kind == kind and c.tuned and not c.hog]
        if tuned:
            best = max(tuned, key=lambda label: median[label])
            name = f"`{kind}` default / its best hand-tuned ({best})"
            verdicts.append(ratio_line(name, default, median[best], TUNED_TARGET))
    hogged = [c.label for c in order if c.hog]
    if hogged and "up default" in median:
        verdicts.append(
            ratio_line(
                "`up` default beside a 1-core hog / quiet",
                median[hogged[0]],
                median["up default"],
                HOG_TARGET,
            )
        )
    machine = machine_line(f"torch {torch.__version__}", f"{cores} usable cores")
    return "\n".join(
        [
            "Each `run`/`up` figure is the run's own \"samples/s (median)\" (the README's "
            "commands: cnn5 cut after block1, the shipped Fashion-MNIST sample, 4 clients, "
            "batch 32, 4 rounds of 50 steps); the plain loop is `benchmarks.sfl_inprocess` on "
            'the same data, the faster of 1 thread and one per core. "default": a fresh '
            "shell (no OMP_*/MKL_* variables, `[runtime] torch_threads = auto`); "
            '"threads=N": `SPLITMQ_RUNTIME__TORCH_THREADS=N`, "active": also '
            "`OMP_WAIT_POLICY=ACTIVE` (without it, `up` gives its children PASSIVE and `run` "
            "keeps OpenMP's default). The hog is one "
            '`python -c "while True: pass"` (as `stress --cpu 1`). Configurations '
            "interleaved, the order rotated each repetition.",
            "",
            *lines,
            "",
            *[f"- {v}" for v in verdicts],
            "",
            f"Machine: {machine}; load average (1/5/15 min) {load_before} at the start, "
            f"{load_average()} at the end.",
            "",
            f"Command: `{command_line('benchmarks.defaults')}`",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--loop-steps",
        type=int,
        default=750,
        help="timed plain-loop steps (750: the runs' 24,000 samples)",
    )
    parser.add_argument("--only", nargs="+", help="labels to run (default: all)")
    parser.add_argument("--no-hog", action="store_true", help="skip the competing-load run")
    parser.add_argument("--timeout", type=float, default=600.0, help="per run, seconds")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    cores = usable_cores()
    order = [
        c
        for c in configs(cores, hog=not args.no_hog)
        if not args.only or c.label in args.only or c.label == "plain loop"
    ]
    load_before = load_average()
    results: dict[str, list[float]] = {c.label: [] for c in order}
    with tempfile.TemporaryDirectory(prefix="splitmq-defaults-") as tmp:
        for rep in range(args.reps):
            shift = rep % len(order)
            for config in order[shift:] + order[:shift]:
                rate = measure(config, Path(tmp), args, cores)
                results[config.label].append(rate)
                print(f"rep {rep} {config.label}: {rate:,.0f} samples/s", file=sys.stderr)
    text = report(results, order, load_before, cores)
    print(text)
    if args.write_docs:
        notes = NOTES.read_text(encoding="utf-8")
        write_section(SECTION, f"{TITLE}\n\n{text}\n\n{notes}")


if __name__ == "__main__":
    main()
