"""SFL-V2 samples/s through RabbitMQ + Redis against the in-process loop; run by hand, not a test.

    python -m benchmarks.sfl_throughput [--models cnn5 lenet5 resnet18] [--reps N]
                                        [--dtypes float32 float16 bfloat16] [--fold 4]
                                        [--default-threads] [--write-docs]

For each model (batch 64, 4 clients, IID partition, data from SPLITMQ_DATA_DIR, default
../shared/data):

- **MQ**: one deployment per smashed dtype (`benchmarks.sfl_deploy`): aggregator, coordinator,
  one worker (`workers.batch_messages = 1`: plain SFL-V2) and 4 clients, each its own process,
  over the real RabbitMQ and Redis; threads set by hand (1 torch thread per client, the
  worker's per model) or, with `--default-threads`, the product's own budget as `splitmq up`
  gives it (`[runtime] torch_threads = auto`). Every round is one repetition: samples counted
  between two reply timestamps once every client is past its warm-up, while all four are busy.
- **in-process**: `benchmarks.sfl_inprocess`, one process doing the same SFL-V2 steps, measured
  right before the first deployment and after each one in every variant (1 or 2 torch threads,
  optionally with passive OpenMP waits); each deployment is compared with the mean of the best
  variants on either side of it, because the load of a shared machine drifts.

Defaults per model (`PLANS`) keep a full run near 15 minutes on 2 idle cores; the table, the
verdicts against the targets and the machine line are printed and, with `--write-docs`, written
to the "sfl-throughput" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import IO

import pika
import torch

from benchmarks.common import command_line, machine_line, write_section
from benchmarks.sfl_deploy import (
    ALLOCATOR_ENV,
    BATCH,
    CLIENTS,
    ROOT,
    Case,
    Deployment,
    DeployResult,
)

SECTION = "sfl-throughput"
TITLE = "## SFL-V2 throughput: RabbitMQ + Redis vs in-process"
# The analysis under the table: prose about mechanisms, kept beside the script that measures.
NOTES = Path(__file__).with_name("sfl_throughput_notes.md")
# cnn5's is the redesign's goal (issue 11: >= 0.85 with float32 on the wire, quiet machine).
TARGETS = {"cnn5": 0.85, "lenet5": 0.70, "resnet18": 0.85}
DTYPES = ("float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Plan:
    """One model's benchmark: what the deployments train and how the in-process loop is timed.

    Sized so a full run stays near 15 minutes on 2 cores: ResNet-18 steps take seconds, so it
    gets few steps per round, and its half-precision deployments one round each.
    """

    model: str
    cut: str
    dataset: str
    data_label: str
    steps: int  # per client and round in a deployment
    warm: int  # replies per client and round before the window opens
    rounds: int  # float32 deployment: windows (= repetitions)
    dtype_rounds: int  # float16/bfloat16 deployments
    dtypes: tuple[str, ...]  # deployed by default
    inproc_steps: int  # per in-process measurement (a multiple of the 4 clients)
    inproc_warm: int
    inproc_max_s: float
    eval_samples: int  # test samples the aggregator evaluates on (0: all)
    # The worker's torch threads: ResNet-18's server side is 3/4 of its compute, worth both
    # cores while the clients wait; the small CNNs' steps are too short to gain from two.
    worker_threads: int = 1


PLANS = {
    "cnn5": Plan(
        "cnn5", "block1", "fashion_mnist", "Fashion-MNIST 28x28",
        steps=60, warm=4, rounds=3, dtype_rounds=3, dtypes=DTYPES,
        inproc_steps=160, inproc_warm=8, inproc_max_s=10.0, eval_samples=0,
    ),
    "lenet5": Plan(
        "lenet5", "block1", "cifar10", "CIFAR-10 32x32x3",
        steps=60, warm=4, rounds=3, dtype_rounds=2, dtypes=("float32",),
        inproc_steps=160, inproc_warm=8, inproc_max_s=10.0, eval_samples=256,
    ),
    "resnet18": Plan(
        "resnet18", "layer1", "cifar10", "CIFAR-10 32x32x3",
        steps=5, warm=1, rounds=2, dtype_rounds=1, dtypes=DTYPES,
        inproc_steps=4, inproc_warm=1, inproc_max_s=30.0, eval_samples=128, worker_threads=2,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Point:
    """In-process rate of one variant ("1", "2": torch threads; "2p": 2 threads, passive wait)."""

    variant: str
    rate: float
    cpu_per_step: float


@dataclass
class ModelRun:
    plan: Plan
    points: list[list[Point]] = field(default_factory=list)  # before deployment 0, after each
    deployments: list[DeployResult] = field(default_factory=list)
    accuracy: list[float | None] = field(default_factory=list)


def variant_threads(variant: str) -> tuple[int, bool]:
    """ "2p" → (2, True): thread count, and whether OpenMP threads wait passively."""
    passive = variant.endswith("p")
    threads = int(variant.removesuffix("p"))
    if threads < 1:
        raise ValueError(f"in-process variant {variant!r}: need at least one thread")
    return threads, passive


class InProcess:
    """The in-process loop in a child process that keeps its model and data between requests.

    The OpenMP wait policy is fixed when a process starts, so each policy gets its own child.
    """

    def __init__(
        self, plan: Plan, data_dir: Path, allocator: bool, passive: bool, size: Case
    ) -> None:
        env = dict(os.environ)
        for name in (*ALLOCATOR_ENV, "OMP_WAIT_POLICY", "OMP_NUM_THREADS"):
            env.pop(name, None)
        if allocator:  # the same allocator settings as the deployment's processes
            env.update(ALLOCATOR_ENV)
        if passive:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        argv = [sys.executable, "-m", "benchmarks.sfl_inprocess", "--serve"]
        argv += ["--model", plan.model, "--cut", plan.cut, "--dataset", plan.dataset]
        argv += ["--data-dir", str(data_dir), "--clients", str(size.clients)]
        argv += ["--batch", str(size.batch), "--train-samples", str(size.train_samples)]
        self._plan = plan
        self._process = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"in-process loop did not start: {ready}")

    def _read(self) -> dict[str, float]:
        stdout: IO[str] | None = self._process.stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"in-process loop exited with {self._process.wait()}")
        answer: dict[str, float] = json.loads(line)
        return answer

    def measure(self, variant: str) -> Point:
        threads, _ = variant_threads(variant)
        plan = self._plan
        request = {
            "threads": threads,
            "warm": plan.inproc_warm,
            "steps": plan.inproc_steps,
            "max_s": plan.inproc_max_s,
        }
        stdin = self._process.stdin
        assert stdin is not None
        stdin.write(json.dumps(request) + "\n")
        stdin.flush()
        answer = self._read()
        return Point(variant, answer["rate"], answer["cpu_per_step"])

    def __enter__(self) -> InProcess:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def best(points: Sequence[Point]) -> Point:
    return max(points, key=lambda p: p.rate)


def final_accuracy(workdir: Path) -> float | None:
    metrics = next(iter(workdir.glob("*/runs/run/metrics.json")), None)
    if metrics is None:
        return None
    records = json.loads(metrics.read_text())["records"]
    return float(records[-1]["global_accuracy"]) if records else None


def run_model(args: argparse.Namespace, plan: Plan, log: IO[str]) -> ModelRun:
    out = ModelRun(plan)
    cases = [
        Case(
            model=plan.model,
            cut=plan.cut,
            dataset=plan.dataset,
            dtype=dtype,
            steps=plan.steps,
            rounds=args.reps or (plan.rounds if dtype == "float32" else plan.dtype_rounds),
            warm=plan.warm,
            worker_threads=args.worker_threads or plan.worker_threads,
            default_threads=args.default_threads,
            allocator=not args.no_allocator,
            eval_samples=plan.eval_samples,
            clients=args.clients,
            batch=args.batch,
            train_samples=args.train_samples,
        )
        for dtype in args.dtypes or plan.dtypes
    ]
    if args.fold > 1:
        cases.append(replace(cases[0], dtype="float32", batch_messages=args.fold))
    with ExitStack() as stack:
        loops = {
            passive: stack.enter_context(
                InProcess(plan, args.data_dir, not args.no_allocator, passive, cases[0])
            )
            for passive in sorted({variant_threads(v)[1] for v in args.inproc})
        }

        def measure_all() -> list[Point]:
            # Every variant each time: which one wins changes with the machine's load.
            points = [loops[variant_threads(v)[1]].measure(v) for v in args.inproc]
            say(log, f"{plan.model}: in-process {fmt_points(points)}")
            return points

        out.points.append(measure_all())
        for case in cases:
            workdir = Path(tempfile.mkdtemp(prefix="sflb-"))
            result = Deployment(case, args.data_dir, workdir).run(args.timeout)
            out.accuracy.append(final_accuracy(workdir))
            if result.problem or args.keep:
                say(log, f"logs of the deployment: {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
            out.deployments.append(result)
            rates = ", ".join(f"{w.rate:.1f}" for w in result.windows)
            say(
                log,
                f"{plan.model} {case.dtype} fold={case.batch_messages}: MQ windows [{rates}] "
                f"samples/s {result.problem} (deployment {result.wall_s:.0f} s)",
            )
            out.points.append(measure_all())
    return out


def fmt_points(points: Sequence[Point]) -> str:
    return ", ".join(f"{p.rate:.1f} samples/s ({p.variant})" for p in points)


def say(log: IO[str], text: str) -> None:
    print(text, file=log, flush=True)


# --- report --------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def cpu_ms(result: DeployResult) -> str:
    """CPU ms per step in the windows: worker / 4 clients together / RabbitMQ."""
    replies = sum(w.replies for w in result.windows)
    if not replies:
        return "-"

    def of(names: Sequence[str]) -> float:
        return sum(w.cpu.get(n, 0.0) for w in result.windows for n in names) * 1e3 / replies

    clients = [f"client-{i}" for i in range(result.case.clients)]
    return f"{of(['worker']):.0f} / {of(clients):.0f} / {of(['rabbitmq']):.0f}"


def cores_busy(result: DeployResult) -> str:
    """Cores the job's processes and RabbitMQ kept busy during the windows, on average."""
    seconds = sum(w.seconds for w in result.windows)
    if not seconds:
        return "-"
    return f"{sum(sum(w.cpu.values()) for w in result.windows) / seconds:.2f}"


@dataclass(frozen=True)
class Row:
    """One deployment against the in-process runs on either side of it."""

    run: ModelRun
    result: DeployResult
    accuracy: float | None
    around: tuple[Point, Point]  # the faster thread count before and after

    @property
    def label(self) -> str:
        plan = self.run.plan
        return f"{plan.model} ({plan.cut}, {plan.data_label})"

    @property
    def dtype(self) -> str:
        case = self.result.case
        return case.dtype + (f", folding {case.batch_messages}" if case.batch_messages > 1 else "")

    @property
    def headline(self) -> bool:
        case = self.result.case
        return case.dtype == "float32" and case.batch_messages == 1

    @property
    def base(self) -> float:
        return statistics.fmean(p.rate for p in self.around)

    @property
    def mq(self) -> float:
        return statistics.median(w.rate for w in self.result.windows)

    @property
    def ratio(self) -> float:
        return self.mq / self.base


def table_rows(runs: Sequence[ModelRun]) -> list[Row]:
    return [
        Row(run, result, run.accuracy[i], (best(run.points[i]), best(run.points[i + 1])))
        for run in runs
        for i, result in enumerate(run.deployments)
    ]


def throughput_table(rows: Sequence[Row]) -> tuple[list[str], list[str]]:
    lines = [
        "| model (cut, data) | smashed dtype | MQ samples/s: median of windows [min-max] "
        "| in-process samples/s (threads) | MQ / in-process | target |",
        "|---|---|---:|---:|---:|---|",
    ]
    verdicts = []
    for row in rows:
        threads = "/".join(sorted({p.variant for p in row.around}))
        base = f"{row.base:.0f} ({threads})"
        result = row.result
        if not result.windows:
            failed = f"failed: {result.problem}"
            lines.append(f"| {row.label} | {row.dtype} | {failed} | {base} | - | - |")
            verdicts.append(f"{row.label} {row.dtype}: no measurement ({result.problem})")
            continue
        rates = [w.rate for w in result.windows]
        spread = f"{row.mq:.0f} [{min(rates):.0f}-{max(rates):.0f}], {len(rates)} window(s)"
        goal = "(not a target)"
        if row.headline:
            target = TARGETS[row.run.plan.model]
            met = "met" if row.ratio >= target else f"NOT met, short by {target - row.ratio:.2f}"
            goal = f">= {target:.2f}: {met}"
            verdicts.append(f"{row.run.plan.model} float32: {row.ratio:.2f}x ({goal})")
        lines.append(
            f"| {row.label} | {row.dtype} | {spread} | {base} | **{row.ratio:.2f}** | {goal} |"
        )
    return lines, verdicts


def diagnostics_table(rows: Sequence[Row]) -> list[str]:
    lines = [
        "| model | smashed dtype | reply body MiB | CPU ms per step, MQ: worker / 4 clients / "
        "RabbitMQ | cores busy, MQ | CPU ms per step, in-process | worker's wait for a "
        "reply's confirm, ms (median) | test accuracy after the run (test images) |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        result = row.result
        in_process = statistics.fmean(p.cpu_per_step for p in row.around) * 1e3
        evaluated = row.run.plan.eval_samples or "all"
        accuracy = "-" if row.accuracy is None else f"{row.accuracy:.1%} ({evaluated})"
        wait = f"{result.confirm_wait_s * 1e3:.1f}" if result.windows else "-"
        lines.append(
            f"| {row.run.plan.model} | {row.dtype} | {mib(result.reply_bytes)} "
            f"| {cpu_ms(result)} | {cores_busy(result)} | {in_process:.0f} | {wait} "
            f"| {accuracy} |"
        )
    return lines


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def threads_setup(args: argparse.Namespace, workers: str) -> str:
    """Which thread settings the deployments ran with, in words."""
    if args.default_threads:
        return (
            "MQ processes at the product's defaults (`--default-threads`): no thread variable "
            "set by hand; each process gets what `splitmq up` gives its children "
            "(`[runtime] torch_threads = auto`: the cores divided among the worker and the "
            "clients, passive OpenMP waits)."
        )
    return (
        "MQ processes tuned by hand (run with `--default-threads` for the product's "
        f"defaults): each client 1 torch thread, the worker {workers} (OMP_WAIT_POLICY=PASSIVE "
        "when more than one: it shares the cores with the clients)."
    )


def report(args: argparse.Namespace, runs: Sequence[ModelRun], load_before: str) -> str:
    rows = table_rows(runs)
    throughput, verdicts = throughput_table(rows)
    allocator = (
        "glibc defaults"
        if args.no_allocator
        else " ".join(f"{k}={v}" for k, v in ALLOCATOR_ENV.items())
    )
    workers = ", ".join(
        f"{run.plan.model} {args.worker_threads or run.plan.worker_threads}" for run in runs
    )
    setup = (
        f"Setup: SFL-V2, batch {args.batch}, {args.clients} clients (IID partition"
        + (f", {args.train_samples} training rows" if args.train_samples else "")
        + "), SGD lr 0.01, one "
        "worker with `batch_messages = 1` (plain SFL-V2) unless marked folding; smashed data "
        "persistent, gradient replies transient, all confirmed. One window per round (steady "
        "state: from the moment every client has had its first replies of the round until the "
        f"first client is done). {threads_setup(args, workers)} The in-process loop: the "
        "fastest of the variants "
        f"{', '.join(args.inproc)} (torch threads; p: OMP_WAIT_POLICY=PASSIVE), all measured "
        "before the first deployment and after each one; each deployment is compared with the "
        "mean of the best variants just before and just after it. Allocator environment of "
        f"every process: `{allocator}`."
    )
    machine = machine_line(f"torch {torch.__version__}", f"pika {pika.__version__}")
    return "\n".join(
        [
            *throughput,
            "",
            *[f"- {v}" for v in verdicts],
            "",
            *diagnostics_table(rows),
            "",
            setup,
            "",
            f"Machine: {machine}; load average (1/5/15 min) {load_before} before, "
            f"{load_average()} after (the machine is shared: other work competes for both "
            "cores and for RabbitMQ, whose CPU column counts every client of the server).",
            "",
            f"Command: `{command_line('benchmarks.sfl_throughput')}`",
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(PLANS), default=list(PLANS))
    parser.add_argument(
        "--reps", type=int, default=0, help="rounds (= windows) per deployment (default: per model)"
    )
    parser.add_argument(
        "--dtypes", nargs="+", choices=DTYPES, default=None, help="default: per model"
    )
    parser.add_argument("--fold", type=int, default=1, help="also run batch_messages=N (N > 1)")
    parser.add_argument(
        "--worker-threads", type=int, default=0, help="worker's torch threads (default: per model)"
    )
    parser.add_argument(
        "--inproc",
        nargs="+",
        default=["1", "2", "2p"],
        help="in-process variants: torch threads, 'p' for OMP_WAIT_POLICY=PASSIVE; the faster wins",
    )
    parser.add_argument(
        "--default-threads",
        action="store_true",
        help="deploy at the product's thread budget ([runtime] torch_threads = auto), as "
        "`splitmq up` does, instead of 1 thread per client and --worker-threads",
    )
    parser.add_argument("--no-allocator", action="store_true", help="glibc malloc defaults")
    parser.add_argument("--clients", type=int, default=CLIENTS, help="simulated clients")
    parser.add_argument("--batch", type=int, default=BATCH, help="batch size per client step")
    parser.add_argument(
        "--train-samples", type=int, default=0, help="rows of the training set used (0: all)"
    )
    parser.add_argument("--timeout", type=float, default=900.0, help="per deployment, seconds")
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=Path(os.environ.get("SPLITMQ_DATA_DIR", ROOT.parent / "shared" / "data")),
    )
    parser.add_argument("--keep", action="store_true", help="keep the deployments' logs")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    args.data_dir = args.data_dir.resolve()
    load_before = load_average()
    runs = [run_model(args, PLANS[name], sys.stderr) for name in args.models]
    text = report(args, runs, load_before)
    print(text)
    if args.write_docs:
        notes = NOTES.read_text(encoding="utf-8")
        write_section(SECTION, f"{TITLE}\n\n{text}\n{notes}")


if __name__ == "__main__":
    main()
