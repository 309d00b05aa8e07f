"""One client floods its shard queue for a whole round of a sync SFL-V2 job (issue 33, point 1).

Every role is a `splitmq` process of its own over the real RabbitMQ and Redis (the soak's
harness, `benchmarks/soak.py`, without its chaos), and so is the flooder: once round
`--flood-round` opens it publishes well-formed one-row SmashedBatches as client-0, with fresh
seqs (`--flood-offset` above client-0's session `seq_base`: the issue's attack used 10^9), as
fast as one confirmed connection goes, until the round's version is published. The same job
runs undisturbed first (same seed), and the two are compared:

- **round times**: the flooded round's time (between the two versions' records) against the
  same round of the undisturbed run, and the median of every round after the first (which
  waits for the processes to start) of each run; the deliverable is at most 1.2x;
- **legitimate batches applied exactly once**: the clients' own batches (client-0's too, the
  flood's left out) seen on a tap queue against the shard checkpoints' per-client audit (count
  and seq sum; a flood batch trained on would show as one applied too many), and the soak's
  accounting of every batch (duplicates, lost, dead-lettered by reason);
- **no version without its server training**: every version's server part differs from the
  previous version's (an identical one was published "from N updates, 0 replicas");
- **queue depths**: every job queue sampled every 0.1 s, the largest against its bound.

    python -m benchmarks.flood_shard --clients 4 --rounds 5 --steps 20 --write-docs

writes its table into docs/benchmarks.md and docs/reliability.md (sections `flood-shard`);
meaningful on a quiet machine only (load < 0.5; the load average at the start is written too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import multiprocessing
import os
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import command_line, machine_line, write_section
from benchmarks.soak import Children, SoakConfig, SoakReport, Tap, run_once
from broker.codec import encode
from broker.errors import BackPressureError, BrokerError, VersionNotFoundError
from broker.messages import SmashedBatch, new_message_id
from broker.rabbitmq import RabbitMQBroker, RabbitMQOptions
from broker.store import SERVER_PART, BlobRef, WeightStore
from broker.topology import (
    SMASHED_EXCHANGE,
    QueueLimits,
    control_queue_name,
    dead_queue_name,
    shard_queue_name,
    shard_routing_key,
    updates_queue_name,
)
from broker.transport import PublishOptions
from services.aggregator.aggregator import ensure_initial_version
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.common.membership import MemberInfo, client_members, member_id
from services.config.root import Settings
from services.runtime.processes import clear_job
from workers.replica import AUDIT_MODULUS
from workers.worker import Worker

LOG = logging.getLogger("splitmq.flood_shard")
FLOODER = "client-0"
DOCS_RELIABILITY = Path(__file__).resolve().parent.parent / "docs" / "reliability.md"
SECTION = "flood-shard"
TARGET = 1.2


@dataclass
class FloodFigures:
    """What one run measured beside the soak's accounting."""

    flooded: bool
    round_s: dict[int, float] = field(default_factory=dict)  # by version published
    flood_sent: int = 0
    flood_refused: int = 0  # publishes the full shard queue refused
    flood_s: float = 0.0
    flood_first_seq: int | None = None
    legit_sent: int = 0  # the clients' own distinct batches on the tap (the flood's left out)
    legit_applied: int = 0  # the checkpoints' audit counts (a flood batch trained on counts)
    legit_seq_sums_differ: int = 0
    versions_without_training: list[int] = field(default_factory=list)
    max_depth: dict[str, int] = field(default_factory=dict)
    bounds: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# --- the flooder --------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloodTarget:
    """Where and as whom the flooder publishes (picklable: it crosses into the flooder)."""

    job: str
    client: str
    shard: int
    round: int
    version: int
    first_seq: int
    shape: tuple[int, ...]


def flood(
    amqp_url: str,
    targets: Connection,
    halt: Any,
    sent: Any,
    refused: Any,
    cores: frozenset[int] | None = None,
) -> None:
    """The flooder process: connected ahead (torch and pika take seconds to start, longer than
    a round), it waits for its target, then publishes one-row batches with fresh seqs,
    confirmed one by one, until `halt`. With `cores` it runs on those alone (its own machine's)."""
    if cores is not None:
        os.sched_setaffinity(0, cores)
    broker = RabbitMQBroker(amqp_url, RabbitMQOptions(connection_name="flood-shard"))
    try:
        target = targets.recv()
        if not isinstance(target, FloodTarget):
            return
        z, y = torch.randn((1, *target.shape)), torch.zeros(1, dtype=torch.int64)
        key = shard_routing_key(target.job, target.shard)
        seq = target.first_seq
        while not halt.is_set():
            batch = SmashedBatch(
                job=target.job,
                client=target.client,
                message_id=new_message_id(),
                version=target.version,
                seq=seq,
                shard=target.shard,
                round=target.round,
                step=0,
                activations=z,
                labels=y,
                steps=1,
            )
            try:
                broker.publish(
                    SMASHED_EXCHANGE, key, encode(batch), PublishOptions(batch.message_id)
                )
            except BackPressureError:
                with refused.get_lock():
                    refused.value += 1
                time.sleep(0.005)
                continue
            seq += 1
            with sent.get_lock():
                sent.value += 1
    finally:
        broker.close()


# --- the run's observer (soak's chaos slot) ------------------------------------------------------


class Observer:
    """Samples queue depths; with `flood`, floods round `flood_round`; at the job's end checks
    the versions and the other clients' batches, while the store still holds them."""

    def __init__(
        self,
        cfg: SoakConfig,
        figures: FloodFigures,
        job: str,
        tap: Tap,
        store: WeightStore,
        *,
        flood_round: int,
        flood_offset: int,
        flooder_cores: frozenset[int] | None = None,
    ) -> None:
        self.cfg, self.figures, self.job, self.tap, self.store = cfg, figures, job, tap, store
        self.flood_round, self.flood_offset = flood_round, flood_offset
        self.flooder_cores = flooder_cores
        limits = QueueLimits()
        self.queues = {
            shard_queue_name(self.job, s): limits.max_length for s in range(cfg.shards)
        } | {
            updates_queue_name(self.job): limits.updates_max_length,
            control_queue_name(self.job): limits.control_max_length,
            dead_queue_name(self.job): limits.dead_max_length,
        }
        figures.bounds = dict(self.queues)

    def run(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        sampler = threading.Thread(target=self._sample, args=(stop, started), daemon=True)
        sampler.start()
        try:
            if self.figures.flooded:
                self._flood(stop)
            stop.wait()
            self._check_versions()
            self._check_legit()
        finally:
            sampler.join(5.0)

    def _flood(self, stop: threading.Event) -> None:
        context = multiprocessing.get_context("spawn")
        targets, target_end = context.Pipe()
        halt = context.Event()
        sent, refused = context.Value("q", 0), context.Value("q", 0)
        args = (self.cfg.amqp_url, target_end, halt, sent, refused, self.flooder_cores)
        process = context.Process(target=flood, args=args, daemon=True)
        process.start()
        try:
            target = self._target(stop)
            targets.send(target)
            if target is None:
                return
            began = time.monotonic()
            LOG.info("flooding shard %d as %s at version %d", target.shard, FLOODER, target.version)
            while not stop.wait(0.05) and self.store.current_version(self.job) <= target.version:
                pass
            self.figures.flood_s = time.monotonic() - began
        finally:
            halt.set()
            process.join(30.0)
        self.figures.flood_sent, self.figures.flood_refused = int(sent.value), int(refused.value)
        LOG.info("flood over: %d sent, %d refused", sent.value, refused.value)

    def _target(self, stop: threading.Event) -> FloodTarget | None:
        """Once round `flood_round` is open: client-0's shard and session (None: the job
        ended first, or client-0 is no member)."""
        while not stop.wait(0.02) and self.store.current_version(self.job) < self.flood_round:
            pass
        member = client_members(self.store, self.job).get(FLOODER)
        if stop.is_set() or member is None:
            self.figures.problems.append("no flood: the job ended, or client-0 is no member")
            return None
        version = self.store.current_version(self.job)
        self.figures.flood_first_seq = member.seq_base + self.flood_offset
        return FloodTarget(
            job=self.job,
            client=FLOODER,
            shard=member.shard,
            round=version - 1,
            version=version,
            first_seq=member.seq_base + self.flood_offset,
            shape=cut_shape(),
        )

    def _sample(self, stop: threading.Event, started: Callable[[], float | None]) -> None:
        while started() is None and not stop.wait(0.1):
            pass  # the queues are declared by then
        options = RabbitMQOptions(connection_name="flood-shard-depths")
        broker = RabbitMQBroker(self.cfg.amqp_url, options)
        depth = self.figures.max_depth
        try:
            while not stop.wait(0.1):
                for queue in self.queues:
                    try:
                        depth[queue] = max(depth.get(queue, 0), broker.queue_depth(queue))
                    except BrokerError:
                        continue  # not declared yet
        finally:
            broker.close()

    def _check_versions(self) -> None:
        """A version whose server part equals the previous one's discarded its round's
        server training."""
        before = None
        for version in range(1, self.store.current_version(self.job) + 1):
            try:
                server = self.store.read_blob(self.job, version, BlobRef(SERVER_PART))
            except VersionNotFoundError:
                continue
            if before is not None and all(
                torch.equal(server[name], before[name]) for name in server
            ):
                self.figures.versions_without_training.append(version)
            before = server

    def _check_legit(self) -> None:
        """The clients' own batches on the tap against the shards' audits."""
        self.tap.drain(30.0)
        figures, flood_from = self.figures, self.figures.flood_first_seq
        sent: dict[tuple[int, str], list[int]] = {}
        for shard, client, seq in self.tap.sent:
            if client != FLOODER or flood_from is None or seq < flood_from:
                sent.setdefault((shard, client), []).append(seq)
        for (shard, client), seqs in sent.items():
            checkpoint = self.store.load_checkpoint(self.job, shard)
            audit = (checkpoint.meta.get("audit") or {}) if checkpoint is not None else {}
            count, seq_sum = (int(v) for v in audit.get(client, (0, 0)))
            figures.legit_sent += len(seqs)
            figures.legit_applied += count
            if count == len(seqs) and seq_sum != sum(seqs) % AUDIT_MODULUS:
                figures.legit_seq_sums_differ += 1


def cut_shape() -> tuple[int, ...]:
    """The activations a client of the soak's job sends (cnn5 cut after block1, on the
    Fashion-MNIST sample: `benchmarks.common.cnn5_sample_sections`)."""
    settings = Settings.model_validate(
        {
            "job": {"name": "shape"},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample"},
        }
    )
    return tuple(job_model(settings).cut_shape("block1"))


def round_times(run_dir: str) -> dict[int, float]:
    """Each version's round time (from its record and the previous one's), the first left out."""
    path = Path(run_dir) / "metrics.json"
    if not path.exists():
        return {}
    records = sorted(json.loads(path.read_text())["records"], key=lambda r: r["version"])
    return {
        b["version"]: float(b["elapsed_s"]) - float(a["elapsed_s"])
        for a, b in itertools.pairwise(records)
    }


def one_run(
    cfg: SoakConfig,
    *,
    flooded: bool,
    flood_round: int,
    flood_offset: int,
    flooder_cores: frozenset[int] | None = None,
) -> tuple[SoakReport, FloodFigures]:
    figures = FloodFigures(flooded=flooded)

    def observe(children: Children, report: SoakReport, tap: Tap, store: WeightStore) -> Observer:
        return Observer(
            cfg,
            figures,
            report.job,
            tap,
            store,
            flood_round=flood_round,
            flood_offset=flood_offset,
            flooder_cores=flooder_cores,
        )

    report = run_once(replace(cfg, chaos=flooded), observe)
    figures.round_s = round_times(report.run_dir)
    return report, figures


# --- a machine of its own for the flooder -------------------------------------------------------


SERVICE_NAMES = ("beam.smp", "redis-server")  # RabbitMQ's VM and Redis: the service's side


def service_tasks() -> list[int]:
    """Every thread of the running RabbitMQ and Redis servers (affinity is per thread)."""
    tids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
            tids += (
                [int(t.name) for t in (entry / "task").iterdir()] if name in SERVICE_NAMES else []
            )
        except OSError:
            continue  # gone meanwhile
    return tids


@contextmanager
def pinned(service_cores: frozenset[int]) -> Iterator[None]:
    """This process (and so every role it starts), RabbitMQ and Redis on `service_cores`, the
    affinities restored after: the cores left over are the flooder's, as if it ran on a machine
    of its own (a client's CPU is not the service's)."""
    before = {tid: os.sched_getaffinity(tid) for tid in [0, *service_tasks()]}
    try:
        for tid in before:
            try:
                os.sched_setaffinity(tid, service_cores)
            except OSError:
                continue  # a thread gone meanwhile
        yield
    finally:
        for tid, cores in before.items():
            try:
                os.sched_setaffinity(tid, cores)
            except OSError:
                continue


# --- the reject path alone ---------------------------------------------------------------------


def reject_seconds(amqp_url: str, redis_url: str, count: int, offset: int) -> float:
    """Seconds one burst worker takes to refuse `count` flood batches queued on its shard (the
    issue's: seqs `offset` above the client's `seq_base`), less its time on an empty queue."""
    job = f"flood-reject-{uuid.uuid4().hex[:6]}"
    settings = Settings.model_validate(
        {
            "broker": {"kind": "rabbitmq", "amqp_url": amqp_url},
            "store": {"kind": "redis", "redis_url": redis_url},
            "job": {"name": job},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample"},
            "algorithm": {"name": "sfl_v2", "batch_size": 32, "max_steps_per_round": 20},
            "workers": {"lease_ttl_s": 10.0, "device": "cpu"},
        }
    )
    backends = Backends(settings.broker, settings.store)
    store, broker = backends.open_store(), backends.open_broker("flood-reject")
    try:
        ensure_initial_version(store, settings, build_strategy("sfl_v2"), LOG)
        info = MemberInfo(FLOODER, 0, "block1", 640, 0, seq_base=1000)
        store.heartbeat(job, member_id(FLOODER), 600.0, info.to_info())
        broker.declare(settings.job_queues())
        _burst(settings, backends)  # the first pays for imports and the optimizer's set-up
        empty = _burst(settings, backends)
        z, y = torch.randn((1, *cut_shape())), torch.zeros(1, dtype=torch.int64)
        for i in range(count):
            batch = SmashedBatch(
                job, FLOODER, new_message_id(), 1, 1000 + offset + i, 0, 0, 0, z, y
            )
            options = PublishOptions(batch.message_id, confirm_later=True)
            broker.publish(SMASHED_EXCHANGE, shard_routing_key(job, 0), encode(batch), options)
        flooded = _burst(settings, backends)
        return flooded - empty
    finally:
        broker.close()
        store.close()
        clear_job(settings, [])


def _burst(settings: Settings, backends: Backends) -> float:
    began = time.perf_counter()
    Worker(settings, backends, worker_id="flood-reject").run(threading.Event(), burst=True)
    return time.perf_counter() - began


# --- the table ----------------------------------------------------------------------------------


def flooded_ratio(
    flood_round: int,
    calm: tuple[SoakReport, FloodFigures],
    flood: tuple[SoakReport, FloodFigures],
) -> float:
    """The flooded round's time over the same round undisturbed (inf: either is missing)."""
    version = flood_round + 1  # the flooded round publishes this version
    calm_t, flood_t = calm[1].round_s.get(version), flood[1].round_s.get(version)
    return flood_t / calm_t if calm_t and flood_t else float("inf")


def ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def table(
    flood_round: int,
    calm: tuple[SoakReport, FloodFigures],
    flood: tuple[SoakReport, FloodFigures],
    rejected: tuple[int, float],
    ratios: list[float],
) -> str:
    (calm_r, calm_f), (flood_r, flood_f) = calm, flood
    version = flood_round + 1  # the flooded round publishes this version
    calm_t, flood_t = calm_f.round_s.get(version), flood_f.round_s.get(version)
    median = {n: statistics.median(f.round_s.values()) if f.round_s else None for n, f in
              (("calm", calm_f), ("flood", flood_f))}  # fmt: skip
    depth = ", ".join(
        f"`{q.split('.', 1)[1]}` {flood_f.max_depth.get(q, 0)} / {b}"
        for q, b in flood_f.bounds.items()
    )
    lines = [
        "| | undisturbed | flooded |",
        "|---|---|---|",
        f"| status | {calm_r.status} | {flood_r.status} |",
        f"| round {flood_round} (the flooded one) | {_s(calm_t)} | {_s(flood_t)} "
        f"({ratio(flood_t, calm_t)}; target <= {TARGET}x) |",
        f"| flooded round / undisturbed, each pair (the median pair shown) | - | "
        f"{', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x) |",
        f"| median round (after the first) | {_s(median['calm'])} | {_s(median['flood'])} "
        f"({ratio(median['flood'], median['calm'])}) |",
        f"| flood | - | {flood_f.flood_sent} batches in {flood_f.flood_s:.1f} s "
        f"({flood_f.flood_sent / max(flood_f.flood_s, 1e-9):.0f}/s), "
        f"{flood_f.flood_refused} publishes refused by the full queue |",
        f"| reject path: one worker, {rejected[0]} flood batches queued | - | "
        f"{1000 * rejected[1] / max(rejected[0], 1):.2f} ms a batch "
        f"({rejected[0] / max(rejected[1], 1e-9):.0f}/s) |",
        f"| the clients' own batches: sent / applied (seq sums differing) | "
        f"{calm_f.legit_sent} / {calm_f.legit_applied} ({calm_f.legit_seq_sums_differ}) | "
        f"{flood_f.legit_sent} / {flood_f.legit_applied} ({flood_f.legit_seq_sums_differ}) |",
        f"| all batches: duplicates / lost | {calm_r.duplicates} / {calm_r.lost} | "
        f"{flood_r.duplicates} / {flood_r.lost} |",
        f"| dead-lettered, by reason | {_reasons(calm_r)} | {_reasons(flood_r)} |",
        f"| versions whose server part equals the previous one's | "
        f"{calm_f.versions_without_training or 'none'} | "
        f"{flood_f.versions_without_training or 'none'} |",
        f"| largest depth / bound | - | {depth} |",
    ]
    return "\n".join(lines)


def _s(value: float | None) -> str:
    return f"{value:.2f} s" if value is not None else "-"


def _reasons(report: SoakReport) -> str:
    return ", ".join(f"{k} {v}" for k, v in report.dead_reasons.items()) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flood-round", type=int, default=3, help="1-based; not the first")
    parser.add_argument("--flood-offset", type=int, default=10**9)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--reject-count", type=int, default=2000, help="for the reject path")
    parser.add_argument(
        "--flooder-core",
        type=int,
        default=None,
        help="run the flooder alone on this core and everything else (the job's roles, "
        "RabbitMQ, Redis) on the others, in both runs: a flooder on a machine of its own",
    )
    parser.add_argument("--reps", type=int, default=1, help="undisturbed/flooded pairs, in turn")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    if not 2 <= args.flood_round <= args.rounds:
        parser.error("--flood-round must be between 2 and --rounds")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("pika").setLevel(logging.WARNING)
    load = os.getloadavg()
    cfg = SoakConfig(
        workers=1,
        clients=args.clients,
        shards=1,  # "sfl" on one shard: SFL-V2
        rounds=args.rounds,
        steps=args.steps,
        seed=args.seed,
        chaos=False,
        timeout_s=args.timeout,
        amqp_url=os.environ.get("SPLITMQ_AMQP_URL", SoakConfig.amqp_url),
        redis_url=os.environ.get("SPLITMQ_REDIS_URL", SoakConfig.redis_url),
    )
    shape = {"flood_round": args.flood_round, "flood_offset": args.flood_offset}
    all_cores = frozenset(os.sched_getaffinity(0))
    flooder_cores = None if args.flooder_core is None else frozenset({args.flooder_core})
    if flooder_cores is not None and not flooder_cores < all_cores:
        parser.error(
            f"--flooder-core must be one of {sorted(all_cores)} and leave one for the rest"
        )
    service_cores = all_cores - (flooder_cores or frozenset())
    with pinned(service_cores) if flooder_cores else nullcontext():
        pairs = [
            (
                one_run(cfg, flooded=False, flooder_cores=flooder_cores, **shape),
                one_run(cfg, flooded=True, flooder_cores=flooder_cores, **shape),
            )
            for _ in range(args.reps)
        ]
        ratios = [flooded_ratio(args.flood_round, calm, flood) for calm, flood in pairs]
        # the pair whose flooded round is the median one is shown in full; every pair is checked
        calm, flood = pairs[sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]]
        rejected = (
            args.reject_count,
            reject_seconds(cfg.amqp_url, cfg.redis_url, args.reject_count, args.flood_offset),
        )
    text = "\n\n".join(
        [
            f"`{command_line('benchmarks.flood_shard')}`, {machine_line()}, load average at "
            f"start {' '.join(f'{x:.2f}' for x in load)}. {args.clients} clients (client-0 "
            f"floods), {args.rounds} rounds of {args.steps} steps, one worker, cnn5 on the "
            f"Fashion-MNIST sample; the flood: one-row SmashedBatches as {FLOODER}, seqs "
            f"{args.flood_offset} above its session's `seq_base`, through round "
            f"{args.flood_round}; "
            + (
                f"the flooder alone on core {args.flooder_core}, the job's roles, RabbitMQ and "
                f"Redis on {', '.join(map(str, sorted(service_cores)))} in both runs (a flooder "
                "on a machine of its own)."
                if flooder_cores
                else "the flooder shares every core with the job, RabbitMQ and Redis."
            ),
            table(args.flood_round, calm, flood, rejected, ratios),
        ]
    )
    print(text)
    for pair in pairs:
        for name, (report, figures) in zip(("undisturbed", "flooded"), pair, strict=True):
            for problem in [*report.problems, *figures.problems]:
                print(f"problem ({name}):", problem)
            LOG.debug("%s: %s %s", name, asdict(report), asdict(figures))
    if args.write_docs:
        section = SECTION if flooder_cores is None else f"{SECTION}-own-core"
        write_section(section, text)
        write_section(section, text, DOCS_RELIABILITY)
    ok = all(
        f[0].status == "finished"
        and not f[1].versions_without_training
        and f[1].legit_sent == f[1].legit_applied
        for _, f in pairs
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
