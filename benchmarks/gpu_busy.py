"""How busy one worker keeps a GPU: ResNet-18 on CIFAR-10, cut after layer1, 16 clients,
float32 and bfloat16 smashed data, the data plane's prefetch off and on (issue 34); needs CUDA.

    python -m benchmarks.gpu_busy [--steps 300] [--dtypes float32 bfloat16]
                                  [--prefetch off on] [--write-docs]

The very `workers.worker.Worker`, on `cuda`, over the in-memory broker and store (a lent GPU
machine reaches no RabbitMQ), serving 16 clients that never keep it waiting: their batches
(64 rows of layer1's 64x32x32 activations, random, with random labels) are encoded before the
clock starts and each client keeps `WINDOW` of them in flight, publishing the next as a reply
comes. So what the worker leaves idle is its own: decode, copies, checks, encode, bookkeeping.

GPU busy is read two ways over the timed steps: `nvidia-smi`'s utilization (the share of each
sample period in which a kernel ran, sampled every 100 ms), and the share of wall time spent
inside server steps, timed with CUDA events around the server side's `step` (an upper bound:
a step's own gaps between kernels count as busy). `scripts/gpu_check.sh` runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import nn

from benchmarks.capacity_null import recast
from benchmarks.common import command_line, machine_line, write_section
from broker.codec import encode
from broker.memory_broker import InMemoryBroker
from broker.messages import RoundStart, SmashedBatch, new_message_id
from broker.topology import SMASHED_EXCHANGE, reply_queue, reply_queue_name, shard_routing_key
from services.algorithms.base import CohortBatch, StepResults
from services.algorithms.recipe import LossFn, cross_entropy
from services.algorithms.registry import build_strategy
from services.algorithms.sfl import SFL, SFLServer
from services.common.backends import Backends, Embedded
from services.common.jobmodel import job_model
from services.config.root import Settings
from workers.worker import Worker

SECTION = "gpu-busy"
CLIENTS = 16
ROWS = 64
CUT = "layer1"
WINDOW = 2  # batches each client keeps in flight
WARMUP = 30  # steps before the clock starts (cuDNN's autotuning, the allocator's first blocks)
WAIT = 60.0


@dataclass(frozen=True, kw_only=True)
class TimedStep(SFLServer):
    """SFL's server side with its steps timed: with CUDA events on the stream they run on
    (read after a synchronize), or on the CPU's clock for a smoke run without a GPU."""

    cuda: bool = True
    spans: list[Callable[[], float]] = field(default_factory=list)  # each step's seconds

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        if not self.cuda:
            began = time.perf_counter()
            try:
                return super().step(server, optimizer, batches, loss=loss)
            finally:
                seconds = time.perf_counter() - began
                self.spans.append(lambda: seconds)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        try:
            return super().step(server, optimizer, batches, loss=loss)
        finally:
            end.record()
            self.spans.append(lambda: start.elapsed_time(end) / 1e3)


@dataclass(frozen=True, kw_only=True)
class TimedSFL(SFL):
    """SFL whose server steps are `TimedStep`'s."""

    cuda: bool = True

    @cached_property
    def server(self) -> TimedStep:
        return TimedStep(u_shaped=True, cuda=self.cuda)


class TimedWorker(Worker):
    """`Worker` with its server steps timed: everything else is the product's."""

    def __init__(self, settings: Settings, backends: Backends, **kwargs: Any) -> None:
        super().__init__(settings, backends, **kwargs)
        cuda = settings.workers.device == "cuda"
        self.strategy = timed = recast(self.strategy, TimedSFL, cuda=cuda)
        self.timed = timed.server


def settings_for(job: str, prefetch: str, device: str) -> Settings:
    return Settings.model_validate(
        {
            "job": {"name": job, "seed": 0},
            "model": {"name": "resnet18", "cut": CUT},
            "data": {"dataset": "cifar10"},
            "algorithm": {"name": "sfl_v2", "lr": 0.01, "batch_size": ROWS},
            "clients": {"count": CLIENTS},
            "workers": {"device": device, "prefetch": prefetch},
        }
    )


@dataclass
class Result:
    dtype: str
    prefetch: str
    steps: int
    seconds: float
    step_busy: float  # share of wall time inside server steps (CUDA events)
    smi_busy: float | None  # nvidia-smi's mean utilization over the timed steps, 0..1

    @property
    def samples_per_s(self) -> float:
        return self.steps * ROWS / self.seconds


@contextlib.contextmanager
def smi_sampler() -> Iterator[list[float]]:
    """nvidia-smi's GPU utilization every 100 ms while inside (empty when there is none)."""
    samples: list[float] = []
    try:
        process = subprocess.Popen(
            [
                "nvidia-smi",
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
                "-i",
                str(torch.cuda.current_device()),
                "-lms",
                "100",
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
    except FileNotFoundError:
        yield samples
        return

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            with contextlib.suppress(ValueError):
                samples.append(float(line.strip()) / 100)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield samples
    finally:
        process.terminate()
        process.wait(5)
        reader.join(5)


def bodies(job: str, model_shape: Sequence[int], dtype: torch.dtype, count: int) -> list[bytes]:
    """`count` encoded SmashedBatches, client by client in turn, seqs rising per client."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn((ROWS, *model_shape), generator=gen).to(dtype)
    y = torch.randint(0, 10, (ROWS,), generator=gen)
    out = []
    for index in range(count):
        client, seq = index % CLIENTS, index // CLIENTS + 1
        batch = SmashedBatch(
            job=job,
            client=f"c{client}",
            message_id=new_message_id(),
            version=1,
            seq=seq,
            shard=0,
            round=0,
            step=seq,
            activations=z,
            labels=y,
        )
        out.append(encode(batch))
    return out


def measure(dtype_name: str, prefetch: str, steps: int, warmup: int, device: str) -> Result:
    job = f"gpubusy-{dtype_name}-{prefetch}"
    settings = settings_for(job, prefetch, device)
    cuda = device == "cuda"
    embedded = Embedded()
    model = job_model(settings, seed=0)
    strategy = build_strategy("sfl_v2", settings.algorithm.params())
    embedded.store.publish_version(job, 0, strategy.initial_weights(model, CUT))
    total = warmup + steps
    queue = list(bodies(job, model.cut_shape(CUT), getattr(torch, dtype_name), total))
    clients = [f"c{i}" for i in range(CLIENTS)]
    feeder = InMemoryBroker(embedded.hub)
    feeder.declare([*settings.job_queues(), *(reply_queue(job, c) for c in clients)])
    by_queue = {reply_queue_name(job, c): c for c in clients}
    for name in by_queue:
        feeder.subscribe(name, prefetch=WINDOW * 2)
    key = shard_routing_key(job, 0)
    start = RoundStart(job, "", new_message_id(), 1, 0, 0, dict.fromkeys(clients, 1))
    feeder.publish(SMASHED_EXCHANGE, key, encode(start))
    waiting = {
        c: [b for i, b in enumerate(queue) if i % CLIENTS == n] for n, c in enumerate(clients)
    }
    worker = TimedWorker(settings, Backends(settings.broker, settings.store, embedded))
    stop = threading.Event()
    thread = threading.Thread(target=worker.run, args=(stop,), name="worker")
    thread.start()
    try:
        for client in clients:
            for _ in range(WINDOW):
                if waiting[client]:
                    feeder.publish(SMASHED_EXCHANGE, key, waiting[client].pop(0))
        with contextlib.ExitStack() as stack:
            began, first_span = 0.0, 0
            samples: list[float] = []
            for done in range(total):
                if done == warmup:
                    if cuda:
                        torch.cuda.synchronize()
                        samples = stack.enter_context(smi_sampler())
                    began = time.perf_counter()
                    first_span = len(worker.timed.spans)
                delivery = feeder.get(WAIT)
                if delivery is None:
                    raise TimeoutError(f"no reply within {WAIT} s after {done} steps")
                feeder.ack(delivery)
                client = by_queue[delivery.queue]
                if waiting[client]:
                    feeder.publish(SMASHED_EXCHANGE, key, waiting[client].pop(0))
            if cuda:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - began
            smi = statistics.fmean(samples) if samples else None
    finally:
        stop.set()
        thread.join(60)
        feeder.close()
    spans = worker.timed.spans[first_span:]
    inside = sum(span() for span in spans)
    return Result(dtype_name, prefetch, steps, seconds, inside / seconds, smi)


def table(results: list[Result]) -> str:
    lines = [
        "| smashed data | prefetch | steps/s | samples/s | GPU busy (nvidia-smi) "
        "| inside server steps (CUDA events) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        smi = "n/a" if r.smi_busy is None else f"{r.smi_busy:.0%}"
        lines.append(
            f"| {r.dtype} | {r.prefetch} | {r.steps / r.seconds:,.1f} | "
            f"{r.samples_per_s:,.0f} | {smi} | {r.step_busy:.0%} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="timed steps per configuration")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prefetch", nargs="+", default=["off", "on"], choices=["off", "on"])
    parser.add_argument("--warmup", type=int, default=WARMUP, help="untimed steps first")
    parser.add_argument(
        "--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run of the harness"
    )
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("benchmarks.gpu_busy needs a CUDA device; torch sees none")
    load = os.getloadavg()[0]
    results = []
    for dtype in args.dtypes:
        for prefetch in args.prefetch:
            print(f"{dtype}, prefetch {prefetch}", file=sys.stderr, flush=True)
            results.append(measure(dtype, prefetch, args.steps, args.warmup, args.device))
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "no GPU (smoke run)"
    text = (
        f"{table(results)}\n\n"
        f"machine: {machine_line(f'torch {torch.__version__}', device)}; 1-minute load "
        f"average {load:.1f} at the start\n\n"
        f"ResNet-18 cut after {CUT}, CIFAR-10 shapes, {ROWS} rows a batch, {CLIENTS} clients "
        f"with {WINDOW} batches in flight each, one worker, in-memory broker and store; "
        f"{args.steps} timed steps after {args.warmup}.\n\n"
        f"command: `{command_line('benchmarks.gpu_busy')}`"
    )
    print(text)
    if args.write_docs:
        write_section(SECTION, f"## GPU busy: one worker serving 16 clients\n\n{LEGEND}\n{text}")


LEGEND = """\
How much of the time one CUDA worker keeps its GPU busy when 16 clients never keep it waiting
(`benchmarks/gpu_busy.py`, run by `scripts/gpu_check.sh` on a lent device): what is left idle is
the worker's data plane (decode, the host-to-device and device-to-host copies, finite checks,
encode) and its bookkeeping. bfloat16 smashed data halves the bytes of every copy; the prefetch
decodes and copies the next batch while the current one steps.
"""


if __name__ == "__main__":
    main()
