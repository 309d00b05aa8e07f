"""Capacity model to 100,000 clients (issue 13 part 6; docs/capacity.md).

    python -m benchmarks.capacity                  # message sizes, the model at 10k / 100k
    python -m benchmarks.capacity --points s.json  # and beside benchmarks.scale_clients points
    python -m benchmarks.capacity --redis-members 10000 100000  # Redis per member (private)
    python -m benchmarks.capacity --bindings 20000 # RabbitMQ memory per binding (local node)

Message sizes are the real codec's bodies of the benchmark job's messages (cnn5 cut after block1
on Fashion-MNIST, batch 32). Everything else the model uses is a measured cost (`Costs`, each
with where it was measured) times a count the protocol fixes (docs/architecture.md): per sampled
client a round is one WeightsAssignment, `steps` SmashedBatch / GradientReply pairs and one
WeightsUpdate; per host, one HostHeartbeat of at most 1,024 members each heartbeat interval.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis
import torch

from broker.codec import encode
from broker.messages import (
    GradientReply,
    HostHeartbeat,
    Join,
    Message,
    SmashedBatch,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.redis_store import RedisWeightStore
from broker.store import MemberKind
from services.algorithms.base import AUX, CLIENT
from services.algorithms.registry import build_strategy
from services.common.handout import client_config
from services.common.jobmodel import job_model
from services.common.membership import HOST_HEARTBEAT_MEMBERS, MemberInfo
from services.config.root import Settings
from services.coordinator.roster import SYNC_SWEEPS

JOB = "scale-sfl-100000-abcdef"  # as long as benchmarks.scale_clients' job names
HOST = "h0"
TRAIN_SAMPLES = 60_000  # Fashion-MNIST's training split, shared out IID by the benchmark
Tensors = Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Sizes:
    """Body bytes of one message of each kind (the codec's output, headers included)."""

    smashed: int
    activations: int  # of which the activations' bytes
    labels: int  # and the labels'
    reply: int
    assignment: int
    welcome: int
    update: int
    fedavg_assignment: int
    fedavg_update: int
    join: int
    host_heartbeat: int  # of HOST_HEARTBEAT_MEMBERS members


def job_settings(algorithm: str = "sfl", batch_size: int = 32) -> Settings:
    return Settings.model_validate(
        {
            "job": {"name": JOB},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist"},
            "algorithm": {"name": algorithm, "batch_size": batch_size},
        }
    )


def sample_messages(batch_size: int = 32) -> dict[str, Message]:
    """One message of each kind, built the way its sender builds it, with the job model's real
    tensors (a forward pass to the cut for the activations)."""
    settings = job_settings("sfl", batch_size)
    model = job_model(settings, seed=0)
    cut = settings.model.cut
    with torch.no_grad():
        z = model.client_blocks(cut)(torch.randn(batch_size, 1, 28, 28))
    y = torch.randint(0, 10, (batch_size,), dtype=torch.int64)
    split = build_strategy("sfl").initial_weights(model, cut)
    whole = build_strategy("fedavg").initial_weights(model, cut)[CLIENT]
    config = client_config(settings, partition=99_999)
    client = f"{HOST}-99999"

    def head(version: int = 7) -> dict[str, Any]:
        return {"job": JOB, "client": client, "message_id": new_message_id(), "version": version}

    def assign(weights: Tensors, aux: Tensors) -> WeightsAssignment:
        return WeightsAssignment(**head(), round=6, participate=True, client_weights=weights,
                                 aux_weights=aux, config=config)  # fmt: skip

    def update(weights: Tensors) -> WeightsUpdate:
        return WeightsUpdate(**head(), round=6, samples=60, client_weights=weights,
                             aux_weights={}, metrics={"train_loss": 0.5})  # fmt: skip

    members = {f"{HOST}-{99_000 + i}": 7 for i in range(HOST_HEARTBEAT_MEMBERS)}
    return {
        "smashed": SmashedBatch(**head(), seq=123, shard=0, round=6, step=1, steps=2,
                                activations=z, labels=y),
        "reply": GradientReply(**head(), seq=123, status="ok", loss=0.5, correct=20,
                               samples=batch_size, grad=torch.zeros_like(z)),
        "assignment": assign(split[CLIENT], split.get(AUX, {})),
        "welcome": Welcome(**head(), shard=0, cut=cut, round=6, client_weights=split[CLIENT],
                           aux_weights=split.get(AUX, {}), config=config),
        "update": update(split[CLIENT]),
        "fedavg_assignment": assign(whole, {}),
        "fedavg_update": update(whole),
        "join": Join(**head(0), samples=60, info={"host": HOST, "session": uuid.uuid4().hex}),
        "host_heartbeat": HostHeartbeat(job=JOB, client=HOST, message_id=new_message_id(),
                                        version=7, members=members),
    }  # fmt: skip


def message_sizes(batch_size: int = 32) -> Sizes:
    messages = sample_messages(batch_size)
    smashed = messages["smashed"]
    assert isinstance(smashed, SmashedBatch)
    z, y = smashed.activations, smashed.labels
    return Sizes(
        activations=z.numel() * z.element_size(),
        labels=y.numel() * y.element_size(),
        **{name: len(encode(message)) for name, message in messages.items()},
    )


@dataclass(frozen=True)
class Costs:
    """Measured costs; docs/capacity.md says where each one was measured. The probes of this
    script (--redis-members, --bindings) replace their defaults with a fresh measurement."""

    host_mib: float = 924.0  # one client host of 500 SFL clients at 10% (scale_clients)
    per_host: int = 500  # clients per host, as measured
    connections_per_host: int = 5  # the dispatcher's + 4 publishing handles (hostlink)
    service_connections: int = 6  # aggregator, coordinator, 2 workers (measured: 11 - 5)
    rabbit_ms_per_mib: float = 5.7  # RabbitMQ CPU per MiB of smashed + reply (sfl_throughput)
    worker_ms_per_step: float = 10.0  # a cnn5 worker's CPU per server step (sfl_throughput)
    tcp_kib_per_connection: float = 100.0  # RabbitMQ networking guide: 80-120 KB by default
    binding_bytes: float = 1_503.0  # per durable binding (--bindings, RabbitMQ 3.10)
    redis_member_bytes: float = 391.0  # per live member (--redis-members 100000)
    redis_renew_us: float = 3.4  # Redis time per member a HostHeartbeat renews
    redis_read_us: float = 3.7  # Redis time per member in a read of all members
    redis_ttl_us: float = 2.0  # Redis time per member the sweep asks about (`member_ttls`)
    reader_read_us: float = 11.2  # the reader's wall per member of that read (Python decode)
    join_commands: int = 10  # membership_ops
    lease_tick_s: float = 10.0 / 3  # a worker's rebalance reads the workers (lease_ttl_s / 3)


@dataclass(frozen=True)
class Scenario:
    clients: int  # live members
    fraction: float = 0.1
    samples_per_client: int = 60  # the 1,000-client point's partition: 2 steps of <= 32
    batch_size: int = 32
    round_s: float = 60.0  # target round time (the benchmark's deadline)
    heartbeat_s: float = 2.0
    session_s: float = 1_980.0  # mean online session: docs/traces.md's lognormal defaults

    @property
    def cohort(self) -> int:
        return min(self.clients, max(1, math.floor(self.fraction * self.clients + 0.5)))

    @property
    def steps(self) -> int:
        return math.ceil(self.samples_per_client / self.batch_size)


def model_rows(s: Scenario, z: Sizes, c: Costs) -> list[tuple[str, str]]:
    """The model's figures for one scenario, as (quantity, value) rows."""
    hosts = math.ceil(s.clients / c.per_host)
    batches = s.cohort * s.steps
    per_round = s.cohort * (2 + 2 * s.steps)
    beats = hosts * math.ceil(min(s.clients, c.per_host) / HOST_HEARTBEAT_MEMBERS)
    joins_s = s.clients / s.session_s
    msgs_s = per_round / s.round_s + beats / s.heartbeat_s + 2 * joins_s
    mib_round = (s.cohort * (z.assignment + z.update) + batches * (z.smashed + z.reply)) / 2**20
    mib_s = mib_round / s.round_s
    connections = hosts * c.connections_per_host + c.service_connections
    worker_cores = batches * c.worker_ms_per_step / 1000 / s.round_s
    workers = max(1, math.ceil(worker_cores))
    read_ms, reader_ms = s.clients * c.redis_read_us / 1000, s.clients * c.reader_read_us / 1000
    # Reads of every client: the aggregator's once a heartbeat interval, the coordinator's
    # every SYNC_SWEEPS-th sweep; the other sweeps ask about the expired (one per session's
    # end); each worker's rebalance reads the workers only.
    reads_s = 1 / s.heartbeat_s + 1 / (s.heartbeat_s * SYNC_SWEEPS)
    renew_s = s.clients / s.heartbeat_s
    busy = (
        renew_s * c.redis_renew_us
        + reads_s * s.clients * c.redis_read_us
        + joins_s * c.redis_ttl_us
        + workers / c.lease_tick_s * workers * c.redis_read_us
    ) / 1e6
    # Before the member kinds and the expired-only sweep: the sweep and every worker's
    # rebalance read every member too.
    reads_before_s = 2 / s.heartbeat_s + workers / c.lease_tick_s
    busy_before = (renew_s * c.redis_renew_us + reads_before_s * s.clients * c.redis_read_us) / 1e6
    broker_mib = (
        connections * c.tcp_kib_per_connection / 1024
        + (s.clients + hosts) * c.binding_bytes / 2**20
    )
    return [
        (f"client hosts ({c.per_host} clients each)", f"{hosts:,}"),
        ("hosts' RSS (SFL)", f"{hosts * c.host_mib / 1024:,.0f} GiB"),
        ("sampled per round", f"{s.cohort:,} x {s.steps} steps"),
        ("broker connections", f"{connections:,}"),
        ("broker queues / bindings", f"{hosts + 8:,} / {s.clients + hosts:,}"),
        ("broker memory: TCP buffers + bindings", f"{broker_mib:,.0f} MiB"),
        ("messages per round", f"{per_round:,}"),
        ("MiB per round (bodies)", f"{mib_round:,.0f}"),
        (f"messages/s at {s.round_s:.0f} s a round", f"{msgs_s:,.0f}"),
        (f"MiB/s at {s.round_s:.0f} s a round", f"{mib_s:,.1f}"),
        ("RabbitMQ cores for the bodies", f"{mib_s * c.rabbit_ms_per_mib / 1000:.2f}"),
        ("worker cores for the server steps", f"{worker_cores:.2f}"),
        ("Redis: member renewals/s", f"{renew_s:,.0f}"),
        ("Redis: joins/s (mean session)", f"{joins_s:,.1f} ({joins_s * c.join_commands:,.0f} cmd)"),
        ("Redis: reads of every client /s", f"{reads_s:.2f} (before: {reads_before_s:.1f})"),
        ("Redis: one read, Redis / reader", f"{read_ms:,.0f} / {reader_ms:,.0f} ms"),
        ("Redis: members the sweep asks about /s", f"{joins_s:,.1f}"),
        ("Redis: busy (renewals + reads)", f"{busy:.0%} (before: {busy_before:.0%})"),
        ("Redis memory for the members", f"{s.clients * c.redis_member_bytes / 2**20:,.1f} MiB"),
    ]  # fmt: skip


def predicted_messages(point: dict[str, Any], fraction: float = 0.1, batch: int = 32) -> float:
    """Messages through the hosts over a run (what scale_clients counts): 2 per session (Join,
    Welcome), per sampled client and round 2 + 2 x steps (none for FedAvg's steps), a dismissal
    per client at the end, and the HostHeartbeats."""
    n, rounds = int(point["clients"]), int(point["rounds"])
    cohort = max(1, math.floor(fraction * n + 0.5))
    steps = 0 if point["algorithm"] == "fedavg" else math.ceil(TRAIN_SAMPLES / n / batch)
    per_host = math.ceil(n / int(point["hosts"]))
    beats = int(point["hosts"]) * math.ceil(per_host / HOST_HEARTBEAT_MEMBERS)
    beats_total = beats * float(point["wall_s"]) / 2.0
    return 2 * int(point["sessions"]) + rounds * cohort * (2 + 2 * steps) + n + beats_total


def loo_line(xs: Sequence[float], ys: Sequence[float], i: int) -> float:
    """y at xs[i] from the least-squares line through the other points (leave one out)."""
    rest = [(x, y) for j, (x, y) in enumerate(zip(xs, ys, strict=True)) if j != i]
    if len(rest) == 1:
        return rest[0][1]
    slope, intercept = statistics.linear_regression([x for x, _ in rest], [y for _, y in rest])
    return slope * xs[i] + intercept


def check_rows(points: list[dict[str, Any]]) -> list[str]:
    """Model vs measured per point: messages (protocol count), SmashedBatches, hosts' RSS and
    broker memory (each predicted from the other points of its algorithm)."""
    rows = []
    for algorithm in sorted({p["algorithm"] for p in points}):
        mine = [p for p in points if p["algorithm"] == algorithm]
        xs = [float(p["clients"]) for p in mine]
        for i, p in enumerate(mine):
            n = int(p["clients"])
            steps = math.ceil(TRAIN_SAMPLES / n / 32)
            pairs: list[tuple[str, float, float]] = [
                ("messages", predicted_messages(p), p["messages_per_s"] * p["wall_s"]),
                ("hosts RSS MiB", loo_line(xs, [q["hosts_rss_mib"] for q in mine], i),
                 p["hosts_rss_mib"]),
                ("broker MiB", loo_line(xs, [q["broker_status_mib"] for q in mine], i),
                 p["broker_status_mib"]),
            ]  # fmt: skip
            if algorithm != "fedavg":
                pairs.insert(1, ("SmashedBatches", p["uploaded"] * steps, p["sent"]))
            for name, model, measured in pairs:
                error = (model - measured) / measured if measured else math.nan
                rows.append(
                    f"| {algorithm} | {n:,} | {name} | {model:,.0f} | {measured:,.0f} | "
                    f"{error:+.1%} |"
                )
    return rows


def redis_probe(url: str, members: int) -> dict[str, float]:
    """Write `members` live members through the store, as Joins do; then Redis's own time
    (INFO commandstats) per member for HostHeartbeat renewals and for a read of all members,
    and used_memory per member. Run against a private server: the counters are server-wide."""
    raw = redis.Redis.from_url(url)
    store = RedisWeightStore(url)
    job = f"capacity-{uuid.uuid4().hex[:6]}"
    ids = [f"{HOST}-{i}" for i in range(members)]
    try:
        base = float(raw.info("memory")["used_memory"])
        for i, client in enumerate(ids):
            info = MemberInfo(client, 0, "block1", 60, i, (0, 1, 2), time.time(), "s" * 32)
            store.heartbeat(job, f"client:{client}", 3_600.0, info.to_info())
        used = float(raw.info("memory")["used_memory"]) - base
        renew = _server_us(raw, lambda: _renew_all(store, job, ids))
        ttls = _server_us(raw, lambda: _renew_all(store, job, ids, ask=True))
        read = _server_us(raw, lambda: store.live_members(job, MemberKind.CLIENT))
        started = time.perf_counter()
        store.live_members(job, MemberKind.CLIENT)
        wall_ms = (time.perf_counter() - started) * 1000
    finally:
        store.delete_job(job)
        store.close()
        raw.close()
    return {
        "members": members,
        "bytes_per_member": used / members,
        "renew_us_per_member": renew / members,
        "ttl_us_per_member": ttls / members,
        "read_us_per_member": read / members,
        "read_ms_redis": read / 1000,
        "read_ms_wall": wall_ms,
    }


def _renew_all(store: RedisWeightStore, job: str, ids: list[str], *, ask: bool = False) -> None:
    """Renew every member, 1,024 a script; with `ask`, ask their seconds left instead (what
    the sweep asks about the members past their deadline)."""
    for start in range(0, len(ids), HOST_HEARTBEAT_MEMBERS):
        batch = [f"client:{c}" for c in ids[start : start + HOST_HEARTBEAT_MEMBERS]]
        if ask:
            store.member_ttls(job, batch)
        else:
            store.renew_members(job, batch, 3_600.0)


def _server_us(raw: redis.Redis, action: Callable[[], object]) -> float:
    """Redis's own microseconds (all commands) spent while `action` ran."""

    def total() -> float:
        stats: dict[str, Any] = raw.info("commandstats")
        return sum(float(v["usec"]) for k, v in stats.items() if k != "cmdstat_info")

    before = total()
    action()
    return total() - before


def binding_probe(url: str, count: int) -> dict[str, float]:
    """RabbitMQ memory per binding: `count` routing keys bound to one durable queue of a
    private durable direct exchange (as the coordinator binds each hosted client's key to its
    host's queue), the node's metadata store read before and after."""
    import pika

    name = f"capacity-probe-{uuid.uuid4().hex[:6]}"
    connection = pika.BlockingConnection(pika.URLParameters(url))
    channel = connection.channel()
    try:
        channel.exchange_declare(name, "direct", durable=True)
        channel.queue_declare(name, durable=True)
        before = _metadata_bytes()
        for i in range(count):
            channel.queue_bind(name, name, routing_key=f"{JOB}.{HOST}-{i}")
        after = _metadata_bytes()
    finally:
        channel.queue_delete(name)
        channel.exchange_delete(name)
        connection.close()
    return {"bindings": count, "bytes_per_binding": (after - before) / count}


def _metadata_bytes() -> float:
    """The node's metadata store in bytes (`rabbitmq-diagnostics memory_breakdown`: mnesia on
    3.x, metadata_store on 4.x); the other categories move with the shared node's traffic."""
    done = subprocess.run(
        ["rabbitmq-diagnostics", "memory_breakdown", "--formatter", "json", "-q"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    breakdown: dict[str, dict[str, float]] = json.loads(done.stdout)
    stores = ("mnesia", "metadata_store")
    return sum(float(v["bytes"]) for k, v in breakdown.items() if k.startswith(stores))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--points", type=Path, help="benchmarks.scale_clients --json output")
    parser.add_argument("--redis-members", type=int, nargs="*", default=[])
    parser.add_argument("--bindings", type=int, default=0)
    parser.add_argument("--amqp-url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--fraction", type=float, nargs="+", default=[0.1, 0.01])
    args = parser.parse_args(argv)
    sizes = message_sizes()
    print(json.dumps({"sizes": sizes.__dict__}, indent=2))
    costs = Costs()
    if args.redis_members:
        from benchmarks.redis_fsync import start_redis

        with tempfile.TemporaryDirectory(prefix="capacity-") as tmp:
            process, port = start_redis("everysec", Path(tmp))
            try:
                probes = [redis_probe(f"redis://127.0.0.1:{port}/0", n) for n in args.redis_members]
            finally:
                process.kill()
                process.wait()
        print(json.dumps({"redis": probes}, indent=2))
        last = probes[-1]
        costs = replace(costs, redis_member_bytes=last["bytes_per_member"],
                        redis_renew_us=last["renew_us_per_member"],
                        redis_ttl_us=last["ttl_us_per_member"],
                        redis_read_us=last["read_us_per_member"])  # fmt: skip
    if args.bindings:
        probe = binding_probe(args.amqp_url, args.bindings)
        print(json.dumps({"rabbitmq": probe}, indent=2))
        costs = replace(costs, binding_bytes=probe["bytes_per_binding"])
    for fraction in args.fraction:
        scenarios = [Scenario(n, fraction=fraction) for n in (10_000, 100_000)]
        print(f"\n| at {fraction:.0%} per round | 10,000 | 100,000 |\n|---|---:|---:|")
        rows = [model_rows(s, sizes, costs) for s in scenarios]
        for (name, ten), (_, hundred) in zip(rows[0], rows[1], strict=True):
            print(f"| {name} | {ten} | {hundred} |")
    if args.points:
        points = json.loads(args.points.read_text())
        print("\n| algorithm | clients | quantity | model | measured | error |")
        print("|---|---:|---|---:|---:|---:|")
        print("\n".join(check_rows(points)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
