"""Null-model capacity: what one worker sustains over the real RabbitMQ when its server step
costs nothing, next to raw pika at the same sizes (issue 34); run by hand, not a test.

    python -m benchmarks.capacity_null [--sizes 100KiB 1.5MiB 16MiB] [--messages 240]
                                       [--runs 3] [--device cpu] [--prefetch auto]
                                       [--url URL] [--redis-url URL] [--write-docs]

The ceiling any worker can reach, GPU or not: every byte and check of the data plane, none of
the compute. Two paths per size, each a load generator in this process and a worker in a
spawned one:

- **worker**: the very `workers.worker.Worker` that `splitmq worker` runs (RabbitMQ, Redis,
  leases, checks, checkpoints, the `workers.device` data plane), its strategy's server step
  replaced by an identity of the right shapes: the gradient is zeros of the activations' shape
  and dtype. The model (`null_model`) has the size's cut shape and one server weight, so a
  checkpoint costs next to nothing. The load generator publishes `SmashedBatch`es of
  `CLIENTS` clients as a client does (`codec.encode`, persistent, confirmed, mandatory) and
  takes their `GradientReply`s from their reply queues (acked, not decoded).
- **raw**: pika as its examples use it. The generator publishes `tensor.numpy().tobytes()`
  (persistent, confirmed, mandatory) on a copy of the shard queue; the worker consumes with the
  same prefetch, publishes a same-size body (transient, mandatory, no wait for a confirm, as
  the worker's replies) and acks each message after its reply.

Both generators keep `window` messages in flight (publishing the next as a reply comes in)
and time `--messages` replies (x4 at 100KiB, x2 at 1.5MiB) after a warm-up, in blocks that
alternate between the paths, `--runs` times. The worker acks at its checkpoints: at most
`checkpoint` steps apart (the default 50, fewer for big bodies, so that the unacked bodies
RabbitMQ keeps stay near `UNACKED_BYTES`). GB/s counts the tensor bytes one way.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import multiprocessing
import multiprocessing.synchronize
import os
import statistics
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, TypeVar

import pika
import torch
from torch import nn

from benchmarks.common import command_line, machine_line, write_section
from benchmarks.rabbitmq_roundtrip import SHAPES
from broker.codec import encode
from broker.messages import RoundStart, SmashedBatch, new_message_id
from broker.rabbitmq import RabbitMQBroker
from broker.redis_store import RedisWeightStore
from broker.topology import SMASHED_EXCHANGE, reply_queue, reply_queue_name, shard_routing_key
from broker.transport import PublishOptions, QueueSpec
from services.algorithms.base import CohortBatch, ServerSide, StepResults, StrategyBase
from services.algorithms.recipe import LossFn, cross_entropy
from services.algorithms.registry import build_strategy
from services.algorithms.sfl import SFL, SFLServer
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.config.root import Settings
from workers.worker import Worker

SECTION = "capacity-null"
DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"
CLIENTS = 16
TARGET = 0.8  # the bound on worker / raw pika, every size
IN_FLIGHT_BYTES = 64 << 20  # what the generator keeps in flight, at most
UNACKED_BYTES = 64 << 20  # what the worker holds unacked between checkpoints, about
MAX_WINDOW = 32
SMALL_SIZE_FACTOR = {"100KiB": 4, "1.5MiB": 2}
WAIT = 60.0  # seconds a reply may take (the worker's first includes its start) before failing
BLOCK = 4  # blocks per run, alternating between the paths
S = TypeVar("S", bound=StrategyBase)


# --- the null model and step ---------------------------------------------------------------------
class _Stub(nn.Module):
    """The client side: a batch of the cut's shape from any input (the generator never runs it:
    it sends random activations)."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_zeros((x.shape[0], *self.shape))


class _Logits(nn.Module):
    """The server side: one weight, so that there is a replica to load and checkpoint."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_classes))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return z.flatten(1)[:, :1] * 0 + self.weight


def null_model(*, shape: Sequence[int], num_classes: int) -> list[tuple[str, nn.Module]]:
    """`[model] name = "benchmarks.capacity_null:null_model"`, cut after `body`."""
    return [("body", _Stub(shape)), ("server", _Logits(num_classes))]


@dataclass(frozen=True)
class NullStep(SFLServer):
    """SFL's server side with a step that is an identity of the right shapes: zero gradients,
    no update."""

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        return [(torch.zeros_like(b.activations), 0.0, 0) for b in batches]


@dataclass(frozen=True, kw_only=True)
class NullSFL(SFL):
    """SFL whose server step is `NullStep`'s."""

    @cached_property
    def server(self) -> ServerSide | None:
        return NullStep(u_shaped=True)


def recast(strategy: StrategyBase, cls: Callable[..., S], **extra: Any) -> S:
    """`strategy`'s settings in `cls`, a subclass of its class that a benchmark built (a
    strategy is a frozen dataclass: its fields are all it holds)."""
    kept = {f.name: getattr(strategy, f.name) for f in dataclasses.fields(strategy) if f.init}
    return cls(**kept, **extra)


def nulled(strategy: StrategyBase) -> NullSFL:
    """`strategy` (an SFL) with the null server step, its settings kept."""
    return recast(strategy, NullSFL)


class NullWorker(Worker):
    """`Worker` with the null server step: everything else is the product's."""

    def __init__(self, settings: Settings, backends: Backends, **kwargs: Any) -> None:
        super().__init__(settings, backends, **kwargs)
        self.strategy = nulled(self.strategy)


@dataclass(frozen=True)
class Job:
    """One size's job: its name, the tensor's shape, the worker's settings."""

    name: str
    size: str
    url: str
    redis_url: str
    device: str
    prefetch: str = "auto"  # workers.prefetch

    @property
    def shape(self) -> tuple[int, ...]:
        return SHAPES[self.size]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    @property
    def window(self) -> int:
        return max(2, min(MAX_WINDOW, IN_FLIGHT_BYTES // self.nbytes))

    @property
    def checkpoint(self) -> int:
        return max(2, min(50, UNACKED_BYTES // self.nbytes))

    def settings(self) -> Settings:
        return Settings.model_validate(
            {
                "job": {"name": self.name, "seed": 0},
                "model": {
                    "name": "benchmarks.capacity_null:null_model",
                    "cut": "body",
                    "options": {"shape": list(self.shape[1:])},
                },
                "data": {"dataset": "fashion_mnist_sample"},
                "algorithm": {"name": "sfl_v2"},
                "clients": {"count": CLIENTS},
                "workers": {
                    "device": self.device,
                    "prefetch": self.prefetch,
                    "checkpoint_every_steps": self.checkpoint,
                },
                "broker": {"kind": "rabbitmq", "amqp_url": self.url},
                "store": {"kind": "redis", "redis_url": self.redis_url},
            }
        )

    def clients(self) -> list[str]:
        return [f"c{i}" for i in range(CLIENTS)]

    def queues(self) -> list[QueueSpec]:
        replies = [reply_queue(self.name, c) for c in self.clients()]
        return [*self.settings().job_queues(), *replies, *self.raw_queues()]

    def raw_queues(self) -> tuple[QueueSpec, QueueSpec]:
        """Copies of shard 0's queue and of one reply queue, under other names."""
        shard = self.settings().job_queues()
        spec = next(s for s in shard if s.routing_key == shard_routing_key(self.name, 0))
        reply = reply_queue(self.name, "raw")
        return (
            dataclasses.replace(spec, name=f"{spec.name}.raw", routing_key=f"{spec.name}.raw"),
            reply,
        )


# --- the workers (spawned processes) -------------------------------------------------------------
def run_worker(job: Job, ready: Any, stop: Any) -> None:
    settings = job.settings()
    halt = threading.Event()

    def relay() -> None:  # Worker.run waits on a thread's event, the parent sets a process's
        stop.wait()
        halt.set()

    threading.Thread(target=relay, daemon=True).start()
    ready.set()
    worker = NullWorker(settings, Backends(settings.broker, settings.store), worker_id="null-0")
    worker.run(halt)


def run_raw_worker(job: Job, ready: Any, stop: Any) -> None:
    shard, reply = job.raw_queues()
    connection = pika.BlockingConnection(pika.URLParameters(job.url))
    channel = connection.channel()
    channel.basic_qos(prefetch_count=job_prefetch(job))
    transient = pika.BasicProperties(delivery_mode=1)

    def on_message(ch: Any, method: Any, _props: Any, body: bytes) -> None:
        grad = bytes(len(body))  # the null gradient: zeros of the received tensor's size
        ch.basic_publish(reply.exchange, reply.routing_key, grad, transient, mandatory=True)
        ch.basic_ack(method.delivery_tag)

    channel.basic_consume(shard.name, on_message)
    ready.set()
    try:
        while not stop.is_set():
            connection.process_data_events(time_limit=0.2)
    finally:
        connection.close()


def job_prefetch(job: Job) -> int:
    """The product worker's prefetch for this job (`WorkerSession.prefetch`), for raw pika."""
    w = job.settings().workers
    return max(2 * w.checkpoint_every_steps, 2 * CLIENTS, 2 * w.batch_messages, 16)


@contextlib.contextmanager
def spawned(target: Callable[..., None], job: Job) -> Iterator[int]:
    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    process = context.Process(target=target, args=(job, ready, stop), daemon=True)
    process.start()
    try:
        if not ready.wait(120) or process.pid is None:
            raise RuntimeError(f"{target.__name__} did not start")
        yield process.pid
    finally:
        stop.set()
        process.join(30)
        if process.is_alive():
            process.terminate()
            process.join(5)


# --- the load generators -------------------------------------------------------------------------
class Generator:
    """Keeps `window` messages in flight and counts replies."""

    name = ""

    def __init__(self, job: Job) -> None:
        self.job = job
        self.tensor = torch.randn(job.shape)
        self.labels = torch.randint(0, 10, (job.shape[0],))

    def block(self, count: int) -> float:
        """Seconds for `count` replies, `window` in flight (none left when it returns)."""
        window = min(self.job.window, count)
        started = time.perf_counter()
        for index in range(window):
            self.send(index % CLIENTS)
        for done in range(count):
            client = self.receive()
            if done + window < count:
                self.send(client)
        return time.perf_counter() - started

    def send(self, client: int) -> None:
        raise NotImplementedError

    def receive(self) -> int:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


_COHORT_SAMPLES = 1 << 30


class WorkerGenerator(Generator):
    name = "worker"

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.broker = RabbitMQBroker(job.url)
        self.clients = job.clients()
        self.seqs = [0] * CLIENTS
        self.by_queue = {reply_queue_name(job.name, c): i for i, c in enumerate(self.clients)}
        for queue in self.by_queue:
            self.broker.subscribe(queue, prefetch=MAX_WINDOW)
        # The cohort: the worker serves only members, and a RoundStart names them, each with
        # samples enough that its round's steps (the worker's per-client credit,
        # workers/gate.py) cover every batch this benchmark sends in its one round.
        cohort = dict.fromkeys(self.clients, _COHORT_SAMPLES)
        start = RoundStart(job.name, "", new_message_id(), 1, 0, 0, cohort)
        self.broker.publish(SMASHED_EXCHANGE, shard_routing_key(job.name, 0), encode(start))

    def send(self, client: int) -> None:
        self.seqs[client] += 1
        batch = SmashedBatch(
            job=self.job.name,
            client=self.clients[client],
            message_id=new_message_id(),
            version=1,
            seq=self.seqs[client],
            shard=0,
            round=0,
            step=self.seqs[client],
            activations=self.tensor,
            labels=self.labels,
        )
        options = PublishOptions(batch.message_id)
        self.broker.publish(
            SMASHED_EXCHANGE, shard_routing_key(self.job.name, 0), encode(batch), options
        )

    def receive(self) -> int:
        delivery = self.broker.get(WAIT)
        if delivery is None:
            raise TimeoutError(f"{self.name}: no reply within {WAIT} s")
        self.broker.ack(delivery)
        return self.by_queue[delivery.queue]

    def close(self) -> None:
        self.broker.close()


class RawGenerator(Generator):
    name = "raw"

    def __init__(self, job: Job) -> None:
        super().__init__(job)
        self.shard, reply = job.raw_queues()
        self.connection = pika.BlockingConnection(pika.URLParameters(job.url))
        self.channel = self.connection.channel()
        self.channel.confirm_delivery()
        self.channel.basic_qos(prefetch_count=MAX_WINDOW)
        self.inbox: deque[Any] = deque()
        self.channel.basic_consume(
            reply.name, lambda _ch, method, _props, _body: self.inbox.append(method)
        )
        self.next_client = 0

    def send(self, client: int) -> None:
        properties = pika.BasicProperties(delivery_mode=2, message_id=new_message_id())
        body = self.tensor.numpy().tobytes()
        self.channel.basic_publish(
            self.shard.exchange, self.shard.routing_key, body, properties, mandatory=True
        )

    def receive(self) -> int:
        deadline = time.monotonic() + WAIT
        while not self.inbox:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no reply within {WAIT} s")
            self.connection.process_data_events(time_limit=left)
        self.channel.basic_ack(self.inbox.popleft().delivery_tag)
        self.next_client = (self.next_client + 1) % CLIENTS
        return self.next_client

    def close(self) -> None:
        self.connection.close()


# --- the run ------------------------------------------------------------------------------------
@dataclass
class Rates:
    """Per path, the messages/s of each timed block."""

    blocks: dict[str, list[float]] = field(default_factory=dict)

    def median(self, path: str) -> float:
        return statistics.median(self.blocks[path])


def publish_version(job: Job) -> None:
    """Version 1 of the null model in Redis, as the aggregator publishes it."""
    settings = job.settings()
    model = job_model(settings, seed=0)
    strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
    with contextlib.closing(RedisWeightStore(job.redis_url)) as store:
        store.publish_version(job.name, 0, strategy.initial_weights(model, "body"))


def measure_size(job: Job, messages: int, runs: int, warmup: int) -> list[Rates]:
    declare(job)
    publish_version(job)
    per_block = max(1, messages // BLOCK)
    out: list[Rates] = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(spawned(run_worker, job))
        stack.enter_context(spawned(run_raw_worker, job))
        generators: list[Generator] = [WorkerGenerator(job), RawGenerator(job)]
        for generator in generators:
            stack.callback(generator.close)
            generator.block(max(warmup, job.window))
        for number in range(runs):
            print(f"{job.size}: run {number + 1} of {runs}", file=sys.stderr, flush=True)
            rates = Rates()
            for index in range(BLOCK):
                # Alternate who goes first, so neither always follows the other.
                order = generators if index % 2 == 0 else generators[::-1]
                for generator in order:
                    seconds = generator.block(per_block)
                    rates.blocks.setdefault(generator.name, []).append(per_block / seconds)
            out.append(rates)
    return out


def declare(job: Job) -> None:
    """Every queue both paths use, before their workers subscribe."""
    with RabbitMQBroker(job.url) as admin:
        admin.declare(job.queues())


def cleanup(job: Job) -> None:
    with RabbitMQBroker(job.url) as admin:
        for spec in job.queues():
            with contextlib.suppress(Exception):  # one already gone is fine
                admin.delete_queue(spec.name)
    with contextlib.closing(RedisWeightStore(job.redis_url)) as store:
        store.delete_job(job.name)


def report(results: dict[str, list[Rates]], jobs: dict[str, Job]) -> tuple[str, bool]:
    lines = [
        "| body | path | messages/s (median of runs) | GB/s one way | x raw | per run x raw |",
        "|---|---|---:|---:|---:|---|",
    ]
    passed = True
    for size, runs in results.items():
        ratios = [r.median("worker") / r.median("raw") for r in runs]
        middle = statistics.median(ratios)
        passed &= middle >= TARGET
        for path in ("worker", "raw"):
            rate = statistics.median(r.median(path) for r in runs)
            gbps = rate * jobs[size].nbytes / 1e9
            ratio = f"**{middle:.2f}**" if path == "worker" else "1.00"
            each = ", ".join(f"{x:.2f}" for x in ratios) if path == "worker" else ""
            lines.append(f"| {size} | {path} | {rate:,.0f} | {gbps:.3f} | {ratio} | {each} |")
    return "\n".join(lines), passed


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument(
        "--messages", type=int, default=240, help="timed replies per path and run at 16MiB"
    )
    parser.add_argument("--runs", type=int, default=3, help="verdict on the median of runs")
    parser.add_argument("--warmup", type=int, default=16, help="untimed replies per path")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--prefetch", default="auto", choices=["auto", "on", "off"], help="workers.prefetch"
    )
    parser.add_argument("--url", default=os.environ.get("SPLITMQ_AMQP_URL", DEFAULT_URL))
    parser.add_argument("--redis-url", default=os.environ.get("SPLITMQ_REDIS_URL", DEFAULT_REDIS))
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    tag = uuid.uuid4().hex[:8]
    jobs = {
        size: Job(f"capnull-{tag}-{i}", size, args.url, args.redis_url, args.device, args.prefetch)
        for i, size in enumerate(args.sizes)
    }
    results: dict[str, list[Rates]] = {}
    for size, job in jobs.items():
        count = args.messages * SMALL_SIZE_FACTOR.get(size, 1)
        try:
            results[size] = measure_size(job, count, args.runs, args.warmup)
        finally:
            cleanup(job)
    table, passed = report(results, jobs)
    with RabbitMQBroker(args.url) as admin:
        info = admin.server_info()
    windows = ", ".join(f"{j.window} at {s}" for s, j in jobs.items())
    checkpoints = ", ".join(f"{j.checkpoint} at {s}" for s, j in jobs.items())
    text = (
        f"{table}\n\n"
        f"worker within {TARGET}x of raw pika at every size (median of runs): "
        f"{'yes' if passed else 'NO'}\n\n"
        f"machine: {machine_line(f'torch {torch.__version__}')}; worker device "
        f"{args.device}, workers.prefetch {args.prefetch}; 1-minute load average "
        f"{load:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end\n\n"
        f"{info.product} {info.version}, pika {pika.__version__}; {CLIENTS} clients; in flight: "
        f"{windows}; checkpoint every {checkpoints} steps; {args.runs} runs of {BLOCK} "
        f"blocks per path, {args.messages} timed replies per run at 16MiB (x2 at 1.5MiB, x4 "
        f"at 100KiB) after {args.warmup} warm-up ones.\n\n"
        f"command: `{command_line('benchmarks.capacity_null')}`"
    )
    print(text)
    if args.write_docs:
        write_section(
            SECTION, f"## Null-model capacity: one worker vs raw pika\n\n{LEGEND}\n{text}"
        )


LEGEND = """\
What one worker sustains when its server step costs nothing (`benchmarks/capacity_null.py`):
the real `Worker` over RabbitMQ and Redis with an identity step of the right shapes (zero
gradients), fed by 16 clients' SmashedBatches, next to raw pika doing the same publish,
consume and reply. No GPU step can serve more messages than this; a GPU worker whose step
takes less than 1 / (messages/s) waits on its data plane.
"""


if __name__ == "__main__":
    main()
