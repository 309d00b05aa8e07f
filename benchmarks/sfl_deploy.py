"""One SFL-V2 job over RabbitMQ and Redis as separate OS processes, timed in steady state.

The processes are those of `splitmq up`: `python -m services.cli.main aggregator|coordinator|
client CONFIG ...`, and for the worker `benchmarks.sfl_probe` (the same `Worker`, plus reply
timestamps). Each child gets its own environment, so torch's intra-op threads are set per role
(`OMP_NUM_THREADS`), and the glibc allocator settings of `ALLOCATOR_ENV` apply to all of them.

Steady state, per round: from the instant every client has had `warm` replies in that round
to the instant the first client got its last one, so all four clients are busy throughout and
joins, round starts, aggregation and evaluation all fall outside. Samples = replies in the
window x batch size. A sampler thread reads the CPU time of every child, RabbitMQ and Redis
four times a second, to say who was busy in the window.
"""

from __future__ import annotations

import bisect
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from benchmarks.common import process_cpu_seconds
from broker.topology import reply_routing_key
from services.config.loading import load_settings
from services.config.root import Settings
from services.report.tomlwrite import dumps
from services.runtime.processes import child_env, clear_job

ROOT = Path(__file__).resolve().parent.parent
# Defaults of the cases (`Case.clients`, `Case.batch`): what docs/benchmarks.md reports.
CLIENTS = 4
BATCH = 64
# glibc malloc: serve large message buffers from the heap and keep freed memory there, so a
# 16 MiB body does not cost a fresh mmap (and its page faults) every time. 32 MiB is the
# largest mmap threshold glibc accepts on 64-bit; the trim threshold keeps the heap top.
ALLOCATOR_ENV: Mapping[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    "MALLOC_TRIM_THRESHOLD_": str(256 * 1024 * 1024),
    "MALLOC_TOP_PAD_": str(64 * 1024 * 1024),
}
SAMPLE_S = 0.25


@dataclass(frozen=True)
class Case:
    """What one deployment trains, and how long."""

    model: str
    cut: str
    dataset: str
    dtype: str = "float32"
    steps: int = 40  # per client per round
    rounds: int = 3
    warm: int = 3  # replies per client and round left out before the window opens
    batch_messages: int = 1
    worker_threads: int = 1
    client_threads: int = 1
    # True: no thread variable set by hand; every process gets what `splitmq up` gives its
    # children (the [runtime] thread budget), and the two fields above are ignored.
    default_threads: bool = False
    allocator: bool = True
    eval_samples: int = 256
    clients: int = CLIENTS
    batch: int = BATCH
    train_samples: int = 0  # data.train_samples: rows of the training split used (0: all)


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    replies: int
    cpu: Mapping[str, float]  # CPU seconds per process name within the window
    batch: int = BATCH  # samples per reply

    @property
    def seconds(self) -> float:
        return self.end - self.start

    @property
    def rate(self) -> float:
        return self.replies * self.batch / self.seconds


@dataclass
class DeployResult:
    case: Case
    windows: list[Window] = field(default_factory=list)
    reply_bytes: int = 0  # median GradientReply body
    confirm_wait_s: float = 0.0  # median time the worker spent publishing a reply, in windows
    problem: str = ""  # why the run produced no usable window ("" when fine)
    wall_s: float = 0.0  # the whole deployment, start-up and shut-down included


def job_config(case: Case, job: str, data_dir: Path, run_dir: Path) -> dict[str, object]:
    return {
        "job": {"name": job, "seed": 0, "rounds": case.rounds},
        "model": {"name": case.model, "cut": case.cut},
        "data": {
            "dataset": case.dataset,
            "dir": str(data_dir),
            "partition": "iid",
            "eval_samples": case.eval_samples,
            "train_samples": case.train_samples,
        },
        "algorithm": {
            "name": "sfl_v2",
            "batch_size": case.batch,
            "lr": 0.01,
            "max_steps_per_round": case.steps,
            "smashed_dtype": case.dtype,
        },
        "clients": {"count": case.clients, "min_to_start": case.clients, "start_timeout_s": 300.0},
        "rounds": {"deadline_s": 900.0},
        "workers": {"count": 1, "batch_messages": case.batch_messages},
        "broker": {"kind": "rabbitmq"},
        "store": {"kind": "redis"},
        "report": {"dir": str(run_dir), "plots": False},
        "log_level": "INFO",
    }


def _system_pids() -> dict[str, int]:
    """RabbitMQ's and Redis's server processes, found by their command names."""
    wanted = {"beam.smp": "rabbitmq", "redis-server": "redis"}
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm in wanted and wanted[comm] not in found:
            found[wanted[comm]] = int(entry.name)
    return found


class CpuSampler:
    """Samples the CPU seconds of named processes in the background."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self._pids = dict(pids)
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            now = time.monotonic()
            reading: dict[str, float] = {}
            for name, pid in self._pids.items():
                try:
                    reading[name] = process_cpu_seconds(pid)
                except OSError:
                    continue  # exited
            self.samples.append((now, reading))

    def at(self, instant: float) -> dict[str, float]:
        """CPU seconds per process at `instant`, interpolated between samples."""
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, instant)
        if i == 0 or i == len(times):
            return self.samples[min(i, len(times) - 1)][1] if self.samples else {}
        (t0, a), (t1, b) = self.samples[i - 1], self.samples[i]
        share = (instant - t0) / (t1 - t0)
        return {k: a[k] + (b[k] - a[k]) * share for k in a if k in b}


def windows(
    replies: Sequence[tuple[float, str, int]], case: Case, job: str, min_bytes: int
) -> tuple[list[tuple[float, float, int]], str]:
    """(start, end, replies) of each round's steady-state window, or a problem.

    A round's window opens at the `warm`-th reply of the last client to get there and closes
    at the last reply of the first client to finish; replies strictly after the opening
    instant and up to the closing one are counted.
    """
    if not 1 <= case.warm < case.steps:
        raise ValueError(f"warm must be in 1..{case.steps - 1}, got {case.warm}")
    keys = [reply_routing_key(job, f"client-{i}") for i in range(case.clients)]
    times: dict[str, list[float]] = {k: [] for k in keys}
    for t, key, size in replies:
        if key in times and size >= min_bytes:  # "stale" answers to duplicates carry no grad
            times[key].append(t)
    expected = case.steps * case.rounds
    short = {k: len(v) for k, v in times.items() if len(v) != expected}
    if short:
        return [], f"expected {expected} gradient replies per client, got {short}"
    out = []
    every = sorted(t for v in times.values() for t in v)
    for r in range(case.rounds):
        first, last = r * case.steps, (r + 1) * case.steps - 1
        start = max(v[first + case.warm - 1] for v in times.values())
        end = min(v[last] for v in times.values())
        if end <= start:
            continue  # a client finished before another got going: no steady state
        count = bisect.bisect_right(every, end) - bisect.bisect_right(every, start)
        out.append((start, end, count))
    return out, "" if out else "no round had all clients busy at once"


class Deployment:
    """Starts the job's processes, waits for the job to end, stops them, collects the trace."""

    def __init__(self, case: Case, data_dir: Path, workdir: Path, python: str = sys.executable):
        self.case = case
        self.job = f"sflb{uuid.uuid4().hex[:10]}"
        self.dir = workdir / self.job
        self.dir.mkdir(parents=True)
        self.config = self.dir / "job.toml"
        self.config.write_text(dumps(job_config(case, self.job, data_dir, self.dir / "runs")))
        self.trace = self.dir / "trace.json"
        self.python = python
        self.data_dir = data_dir
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._logs: list[IO[bytes]] = []

    def settings(self, env: Mapping[str, str]) -> Settings:
        return load_settings(self.config, env)

    def env(self, threads: int) -> dict[str, str]:
        env = dict(os.environ)
        for name in (*ALLOCATOR_ENV, "OMP_WAIT_POLICY"):
            env.pop(name, None)
        if self.case.allocator:
            env.update(ALLOCATOR_ENV)
        if self.case.default_threads:
            for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "SPLITMQ_RUNTIME__TORCH_THREADS"):
                env.pop(name, None)
            env = child_env(env, workers=1, clients=self.case.clients)
            env.update(SPLITMQ_DATA_DIR=str(self.data_dir))
            return env
        if threads > 1:
            # Sharing two cores with the clients, spinning OpenMP threads wait for a
            # descheduled sibling for whole time slices; passive ones sleep instead.
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        env.update(
            SPLITMQ_DATA_DIR=str(self.data_dir),
            PYTHONUNBUFFERED="1",
            PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
        )
        return env

    def _start(self, name: str, argv: list[str], threads: int) -> None:
        log = (self.dir / f"{name}.log").open("wb")
        self._logs.append(log)
        self._children[name] = subprocess.Popen(
            argv,
            cwd=ROOT,
            env=self.env(threads),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def run(self, timeout_s: float) -> DeployResult:
        case = self.case
        result = DeployResult(case)
        settings = self.settings(self.env(1))
        clients = [f"client-{i}" for i in range(case.clients)]
        clear_job(settings, clients)
        started = time.monotonic()
        role = [self.python, "-m", "services.cli.main"]
        cfg = str(self.config)
        try:
            runs = str(self.dir / "runs" / "run")
            self._start("aggregator", [*role, "aggregator", cfg, "--run-dir", runs], 1)
            self._start("coordinator", [*role, "coordinator", cfg], 1)
            probe = [self.python, "-m", "benchmarks.sfl_probe", cfg, "--id", "worker-0"]
            self._start("worker", [*probe, "--trace", str(self.trace)], case.worker_threads)
            for i, name in enumerate(clients):
                argv = [*role, "client", cfg, "--id", name, "--partition", str(i)]
                self._start(name, argv, case.client_threads)
            pids = {name: p.pid for name, p in self._children.items()} | _system_pids()
            with CpuSampler(pids) as sampler:
                result.problem = self._wait(started + timeout_s)
            self._stop_all()
        finally:
            self._kill_all()
            for log in self._logs:
                log.close()
            clear_job(settings, clients)
        result.wall_s = time.monotonic() - started
        if result.problem:
            return result
        if not self.trace.is_file():
            result.problem = f"the worker wrote no trace (see {self.dir / 'worker.log'})"
            return result
        trace = json.loads(self.trace.read_text())["replies"]
        replies = [(float(t), str(k), int(n), float(w)) for t, k, n, w in trace]
        min_bytes = grad_bytes(settings, case)
        spans, result.problem = windows([r[:3] for r in replies], case, self.job, min_bytes)
        sizes = [n for _, _, n, _ in replies if n >= min_bytes]
        result.reply_bytes = int(statistics.median(sizes)) if sizes else 0
        waits = [w for t, _, _, w in replies if any(s < t <= e for s, e, _ in spans)]
        result.confirm_wait_s = statistics.median(waits) if waits else 0.0
        for start, end, count in spans:
            a, b = sampler.at(start), sampler.at(end)
            cpu = {k: b[k] - a[k] for k in a if k in b}
            result.windows.append(Window(start, end, count, cpu, case.batch))
        return result

    def _wait(self, deadline: float) -> str:
        aggregator = self._children["aggregator"]
        while True:
            code = aggregator.poll()
            if code is not None:
                return "" if code == 0 else f"the aggregator exited with {code}"
            for name, child in self._children.items():
                failed = child.poll()
                if failed is not None and failed != 0:
                    return f"{name} exited with {failed} (see {self.dir / (name + '.log')})"
            if time.monotonic() > deadline:
                return f"timed out (logs in {self.dir})"
            time.sleep(0.2)

    def _stop_all(self, grace_s: float = 30.0) -> None:
        for child in self._children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self._children.values():
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _kill_all(self) -> None:
        for child in self._children.values():
            if child.poll() is None:
                child.kill()
                child.wait()


def grad_bytes(settings: Settings, case: Case) -> int:
    """Bytes of one batch's gradient on the wire: the least a real (non-stale) reply carries."""
    from services.common.jobmodel import job_model

    shape = job_model(settings).cut_shape(case.cut)
    size = case.batch * {"float32": 4, "float16": 2, "bfloat16": 2}[case.dtype]
    for dim in shape:
        size *= dim
    return size
