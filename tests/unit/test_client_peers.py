"""Scripted stand-ins for the coordinator, aggregator and worker a client talks to, and the
in-process reference loops the client's results are compared with.

No tests here: the client's unit tests (in-memory hub) and its RabbitMQ test share these.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.nn import functional as F

from broker.codec import decode, encode
from broker.messages import (
    Error,
    GradientReply,
    Heartbeat,
    Join,
    Leave,
    Message,
    RoundDropped,
    RoundStart,
    SmashedBatch,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.store import AUX_PART, CLIENT_PART, BlobRef
from broker.topology import (
    REPLIES_EXCHANGE,
    SMASHED_EXCHANGE,
    QueueLimits,
    control_queue,
    dead_queue,
    reply_queue_name,
    reply_routing_key,
    shard_queue,
    shard_routing_key,
    updates_queue,
)
from broker.transport import Broker, QueueSpec
from models.split import SplitNet
from models.state import client_state
from services.algorithms.base import Hyper, full_state
from services.algorithms.registry import build_strategy
from services.algorithms.sfl import weighted_step
from services.common.backends import Backends
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.batches import ClientBatches
from services.data.loaders import Dataset
from services.data.partition import partition

Tensors = dict[str, torch.Tensor]


def make_settings(job: str, **sections: dict[str, Any]) -> Settings:
    """Small, fast job settings: cnn5 cut after block1, 60-sample partitions (4 batches an
    epoch), rounds of 5 steps that cross an epoch boundary."""
    base: dict[str, dict[str, Any]] = {
        "job": {"name": job, "seed": 7},
        "model": {"name": "cnn5", "cut": "block1"},
        "data": {"dataset": "fashion_mnist_sample", "partition": "iid"},
        "algorithm": {
            "name": "sfl_v2",
            "batch_size": 16,
            "lr": 0.05,
            "momentum": 0.5,
            "local_epochs": 2,
            "max_steps_per_round": 5,
        },
        "clients": {"count": 100, "heartbeat_s": 0.05, "reply_timeout_s": 10.0},
    }
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    return Settings.model_validate(base)


def seeded_model(settings: Settings) -> SplitNet:
    """The job's model with the seeded initial weights (what the aggregator publishes as v1)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.job.seed)
        return job_model(settings)


def hyper(settings: Settings) -> Hyper:
    a = settings.algorithm
    return Hyper(lr=a.lr, momentum=a.momentum, server_lr=a.server_lr)


def partition_indices(settings: Settings, dataset: Dataset, index: int) -> Any:
    return partition(
        dataset.train.y.numpy(), "iid", settings.clients.count, seed=settings.job.seed
    )[index]


def round_batches(
    settings: Settings, dataset: Dataset, index: int, round_index: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The batches the client should train on in `round_index`: epochs numbered across rounds,
    capped at max_steps_per_round."""
    a = settings.algorithm
    batches = ClientBatches(
        dataset.train.x,
        dataset.train.y,
        partition_indices(settings, dataset, index),
        batch_size=a.batch_size,
        seed=settings.job.seed,
        client=index,
    )
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for e in range(a.local_epochs):
        out.extend(batches.epoch(round_index * a.local_epochs + e))
    return out[: a.max_steps_per_round or None]


def reference_split(settings: Settings, dataset: Dataset, index: int, rounds: int) -> list[Tensors]:
    """Plain SFL written out by hand: the client-side state after each round."""
    model = seeded_model(settings)
    cut = settings.model.cut
    body = model.client_blocks(cut)
    server = copy.deepcopy(model.server_blocks(cut))
    h = hyper(settings)
    server_opt = h.server_optimizer(server.parameters())
    out = []
    for r in range(rounds):
        client_opt = torch.optim.SGD(body.parameters(), lr=h.lr, momentum=h.momentum)
        for x, y in round_batches(settings, dataset, index, r):
            z = body(x)
            grad = weighted_step(server, server_opt, [z.detach()], [y], [1.0]).grads[0]
            client_opt.zero_grad()
            z.backward(grad)
            client_opt.step()
        out.append({k: v.clone() for k, v in client_state(model, cut).items()})
    return out


def reference_fedavg(settings: Settings, dataset: Dataset, index: int) -> Tensors:
    """One FedAvg round written out by hand: the whole model trained locally."""
    model = seeded_model(settings)
    h = hyper(settings)
    opt = torch.optim.SGD(
        [p for n, p in model.named_parameters() if n.startswith("blocks.")],
        lr=h.lr,
        momentum=h.momentum,
    )
    model.train()
    for x, y in round_batches(settings, dataset, index, 0):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return full_state(model)


def max_diff(a: Tensors, b: Tensors) -> float:
    assert set(a) == set(b)
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


@dataclass
class PeerScript:
    """How the fake service side behaves."""

    rounds: int = 1
    welcome_partition: int | None = None  # Welcome.config["partition"]
    ignore_joins: int = 0  # the first N Joins go unanswered
    assign: bool = True  # send round assignments after the Welcome
    finish_at_once: bool = False  # answer the Welcome with the job-finished assignment
    duplicate_replies: bool = False  # each GradientReply again, with a bogus gradient
    ignore_first_batch: bool = False  # no reply to the first SmashedBatch delivery
    stale_before_ok: bool = False  # hold the first batch; answer its copy "stale", then "ok"
    silent_until_finish: int = 0  # never answer; finish the job at this many deliveries
    reject_batches: bool = False  # GradientReply status "rejected", then finish the job
    # Apply the first batch without a reply (lost); answer its copy "gone"; finish on the drop.
    gone_after_first: bool = False
    # With each gradient, and before each later assignment, a GradientReply for a seq the
    # client never sent (a bogus gradient: applying it would move the weights).
    unsent_replies: bool = False
    bad_assignment: bool = False  # an assignment whose weights do not fit, before the real one
    shard_max_length: int | None = None
    filler: bool = False  # a RoundStart on the shard queue ahead of the round
    worker_gate: threading.Event | None = None  # the worker consumes only once this is set
    # Answer the first heartbeat with Error(unknown_member); assign only after a re-Join.
    forget_member: bool = False
    # The Welcomes' seq_base, in order (the last one repeats; none: 0).
    seq_bases: tuple[int, ...] = ()
    before_welcome: list[tuple[bytes, str]] = field(default_factory=list)  # (body, routing key)
    # Answer the first update round_closed (its round closed without it) and reopen the round:
    # a new assignment for the same round.
    close_before_first_update: bool = False


@dataclass
class PeerLog:
    joins: list[Join] = field(default_factory=list)
    heartbeats: int = 0
    leaves: list[Leave] = field(default_factory=list)
    updates: list[WeightsUpdate] = field(default_factory=list)
    drops: list[RoundDropped] = field(default_factory=list)
    batches: list[tuple[int, str]] = field(default_factory=list)  # (seq, message_id) delivered
    welcomes: int = 0
    failure: BaseException | None = None


class ScriptedPeers(threading.Thread):
    """Coordinator, aggregator and worker of one job with one shard, as one scripted thread.

    Runs until the client's Leave arrives, or until `halt` is set and its queues are idle;
    `log` records what it saw.
    """

    def __init__(
        self, settings: Settings, backends: Backends, script: PeerScript, halt: threading.Event
    ) -> None:
        super().__init__(name="scripted-peers", daemon=True)
        self.settings = settings
        self.backends = backends
        self.script = script
        self.halt = halt
        self.log = PeerLog()
        self.ready = threading.Event()
        self.heartbeat_seen = threading.Event()  # the client has taken in its Welcome
        self.job = settings.job.name
        self.cut = settings.model.cut
        model = seeded_model(settings)
        strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        initial = strategy.initial_weights(model, self.cut)
        self.client_weights: Tensors = dict(initial[BlobRef(CLIENT_PART)])
        self.aux_weights: Tensors = dict(initial.get(BlobRef(AUX_PART), {}))
        self.server = copy.deepcopy(model.server_blocks(self.cut))
        self.cut_shape = tuple(model.cut_shape(self.cut))
        self.server_opt = hyper(settings).server_optimizer(self.server.parameters())
        self.version = 1
        self.round = 0
        self.applied_seq = -1
        self.held: SmashedBatch | None = None
        limits = QueueLimits(max_length=script.shard_max_length or QueueLimits().max_length)
        self.queues: list[QueueSpec] = [
            dead_queue(self.job),
            control_queue(self.job),
            updates_queue(self.job),
            shard_queue(self.job, 0, limits),
        ]

    def run(self) -> None:
        try:
            broker = self.backends.open_broker("scripted-peers")
            try:
                self._serve(broker)
            finally:
                broker.close()
        except BaseException as exc:  # surfaced by the test through log.failure
            self.log.failure = exc
            self.ready.set()

    def finish(self, timeout: float = 10.0) -> PeerLog:
        self.join(timeout)
        assert not self.is_alive(), "scripted peers did not finish"
        if self.log.failure is not None:
            raise self.log.failure
        return self.log

    # --- loop ---------------------------------------------------------------------------------

    def _serve(self, broker: Broker) -> None:
        broker.declare(self.queues)
        if self.script.filler:
            filler = RoundStart(self.job, "", new_message_id(), 1, 0, 0, {"c": 1})
            broker.publish(SMASHED_EXCHANGE, shard_routing_key(self.job, 0), encode(filler))
        for name in (self.queues[1].name, self.queues[2].name):
            broker.subscribe(name, prefetch=8)
        self.ready.set()
        worker_on = False
        handlers: dict[str, Callable[[Broker, Message], None]] = {
            self.queues[1].name: self._control,
            self.queues[2].name: self._update,
            self.queues[3].name: self._smashed,
        }
        while not self.log.leaves:
            gate = self.script.worker_gate
            if not worker_on and (gate is None or gate.is_set()):
                broker.subscribe(self.queues[3].name, prefetch=1)
                worker_on = True
            delivery = broker.get(0.02)
            if delivery is None:
                if self.halt.is_set():
                    return
                continue
            handlers[delivery.queue](broker, decode(delivery.body))
            broker.ack(delivery)

    def _reply(self, broker: Broker, client: str, message: Message) -> None:
        broker.publish(REPLIES_EXCHANGE, reply_routing_key(self.job, client), encode(message))

    # --- coordinator ----------------------------------------------------------------------------

    def _control(self, broker: Broker, message: Message) -> None:
        if isinstance(message, Heartbeat):
            self.log.heartbeats += 1
            self.heartbeat_seen.set()
            if self.script.forget_member and self.log.heartbeats == 1:
                forgotten = Error(
                    self.job, message.client, new_message_id(), self.version,
                    "unknown_member", "unknown member, join first", message.message_id,
                )  # fmt: skip
                self._reply(broker, message.client, forgotten)
        elif isinstance(message, Leave):
            self.log.leaves.append(message)
        elif isinstance(message, Join):
            self.log.joins.append(message)
            if len(self.log.joins) <= self.script.ignore_joins:
                return
            first = self.log.welcomes == 0
            if self.script.forget_member:
                # Welcomed once, forgotten, then assigned only after joining again.
                first = self.log.welcomes == 1
            if first:
                for body, key in self.script.before_welcome:
                    broker.publish(REPLIES_EXCHANGE, key, body)
            self._reply(broker, message.client, self._welcome(message.client))
            self.log.welcomes += 1
            if first and self.script.finish_at_once:
                self._reply(broker, message.client, self._finished(message.client))
            elif first and self.script.assign:
                if self.script.bad_assignment:
                    bad = self._assignment(message.client)
                    name = next(iter(self.client_weights))
                    bad = replace(bad, client_weights={name: torch.zeros(3)})
                    self._reply(broker, message.client, bad)
                self._reply(broker, message.client, self._assignment(message.client))

    def _welcome(self, client: str) -> Welcome:
        config: dict[str, str | int | float | bool] = {"algorithm": self.settings.algorithm.name}
        if self.script.welcome_partition is not None:
            config["partition"] = self.script.welcome_partition
        bases = self.script.seq_bases
        seq_base = bases[min(self.log.welcomes, len(bases) - 1)] if bases else 0
        return Welcome(
            self.job, client, new_message_id(), self.version, 0, self.cut, 0,
            self.client_weights, self.aux_weights, config, seq_base,
        )  # fmt: skip

    def _assignment(self, client: str) -> WeightsAssignment:
        return WeightsAssignment(
            self.job, client, new_message_id(), self.version, self.round, True,
            self.client_weights, self.aux_weights, {},
        )  # fmt: skip

    def _finished(self, client: str) -> WeightsAssignment:
        return WeightsAssignment(
            self.job, client, new_message_id(), self.version, self.round, False, {}, {},
            {"finished": True},
        )  # fmt: skip

    # --- aggregator -----------------------------------------------------------------------------

    def _update(self, broker: Broker, message: Message) -> None:
        if isinstance(message, RoundDropped):
            self.log.drops.append(message)
            if self.script.gone_after_first:
                self._reply(broker, message.client, self._finished(message.client))
            return
        assert isinstance(message, WeightsUpdate)
        self.log.updates.append(message)
        if self.script.close_before_first_update and len(self.log.updates) == 1:
            late = Error(
                self.job, message.client, new_message_id(), self.version,
                "round_closed", f"round {message.round} is closed", message.message_id,
            )  # fmt: skip
            self._reply(broker, message.client, late)
            self._reply(broker, message.client, self._assignment(message.client))
            return
        if len(self.log.updates) < self.script.rounds + self.script.close_before_first_update:
            # One client: the next version's client side is its own update.
            self.client_weights = {k: v.clone() for k, v in message.client_weights.items()}
            self.version += 1
            self.round += 1
            if self.script.unsent_replies:
                self._reply(broker, message.client, self._unsent(message.client, 2**62))
            self._reply(broker, message.client, self._assignment(message.client))
        else:
            self._reply(broker, message.client, self._finished(message.client))

    # --- worker ---------------------------------------------------------------------------------

    def _smashed(self, broker: Broker, message: Message) -> None:
        if not isinstance(message, SmashedBatch):
            return  # the filler RoundStart
        self.log.batches.append((message.seq, message.message_id))
        delivered = len(self.log.batches)
        script = self.script
        if script.silent_until_finish:
            if delivered == script.silent_until_finish:
                self._reply(broker, message.client, self._finished(message.client))
            return
        if script.gone_after_first:
            if delivered == 1:
                self.applied_seq = message.seq  # applied; its reply lost
                return
            gone = GradientReply(
                self.job, message.client, new_message_id(), self.version, message.seq,
                "gone", 0.0, 0, 0, None, "duplicate: its gradient is no longer kept",
            )  # fmt: skip
            self._reply(broker, message.client, gone)
            return
        if delivered == 1 and (script.ignore_first_batch or script.stale_before_ok):
            self.held = message if script.stale_before_ok else None
            return
        held = self.held
        if message.seq <= self.applied_seq or (held is not None and message.seq == held.seq):
            # What the real worker does with a copy of a seq it holds or has applied.
            stale = GradientReply(
                self.job, message.client, new_message_id(), self.version, message.seq,
                "stale", 0.0, 0, 0, None, "duplicate",
            )  # fmt: skip
            self._reply(broker, message.client, stale)
            if held is not None:
                self.held = None
                self._apply(broker, held)
            return
        self._apply(broker, message)

    def _apply(self, broker: Broker, message: SmashedBatch) -> None:
        if self.script.reject_batches:
            reply = GradientReply(
                self.job, message.client, new_message_id(), self.version, message.seq,
                "rejected", 0.0, 0, 0, None, "scripted rejection",
            )  # fmt: skip
            self._reply(broker, message.client, reply)
            self._reply(broker, message.client, self._finished(message.client))
            return
        self.applied_seq = message.seq
        result = weighted_step(
            self.server, self.server_opt, [message.activations], [message.labels], [1.0]
        )
        grad = result.grads[0]
        reply = GradientReply(
            self.job, message.client, new_message_id(), self.version, message.seq, "ok",
            result.losses[0], result.correct[0], int(message.labels.shape[0]), grad,
        )  # fmt: skip
        self._reply(broker, message.client, reply)
        if self.script.unsent_replies:
            self._reply(broker, message.client, self._unsent(message.client, message.seq + 10**9))
        if self.script.duplicate_replies:
            bogus = GradientReply(
                self.job, message.client, new_message_id(), self.version, message.seq, "ok",
                9.0, 0, int(message.labels.shape[0]), grad * 1000.0 + 1.0,
            )  # fmt: skip
            self._reply(broker, message.client, bogus)

    def _unsent(self, client: str, seq: int) -> GradientReply:
        shape = (self.settings.algorithm.batch_size, *self.cut_shape)
        return GradientReply(
            self.job, client, new_message_id(), self.version, seq, "ok", 9.0, 0, 1,
            torch.full(shape, 1000.0),
        )  # fmt: skip


def peer_queue_names(job: str, client: str) -> list[str]:
    """Every queue a client test creates, for teardown."""
    return [
        dead_queue(job).name,
        control_queue(job).name,
        updates_queue(job).name,
        shard_queue(job, 0).name,
        reply_queue_name(job, client),
    ]


__all__ = [
    "PeerLog",
    "PeerScript",
    "ScriptedPeers",
    "make_settings",
    "max_diff",
    "peer_queue_names",
    "reference_fedavg",
    "reference_split",
    "round_batches",
    "seeded_model",
]
