"""A shard's U-shaped step between its two halves (docs/architecture.md, "U-shaped split").

A SmashedBatch (without labels) opens it: the server's forward keeps its graph and sends the
output to the client as a ServerOutput; the client's TailGradient finishes it. One step is open
at a time; batches arriving meanwhile wait in the runner's fold or barrier. An open step's
deliveries stay unacked and a checkpoint taken while it is open holds the replica as before its
forward (`buffers`, BatchNorm's running statistics included), so a crash in between redelivers
the batch and its tail gradient and the step is applied once.

`UShapedStep` does the tensor work and sends the outputs; what the step's end means for the
shard (recording, answering, rolling back) the runner does with the `Backward` it gets.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch

from broker.messages import ServerOutput, SmashedBatch, TailGradient, new_message_id
from broker.tensors import all_finite
from broker.topology import reply_routing_key
from broker.transport import Delivery
from models.state import load_partial
from services.algorithms.base import OpenStep, StepResults
from services.algorithms.ushape import backward_open
from workers.replica import Replica
from workers.replies import answer
from workers.shard_io import Item, ShardIO

# Tail gradients kept for a batch not forwarded yet (a queue's take-over may reorder the two).
_ORPHANS = 64


class ForwardFailedError(Exception):
    """The strategy's forward raised `cause`; the replica's buffers are as before it."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(repr(cause))
        self.cause = cause


@dataclass(eq=False)
class Open:
    """A U-shaped step between its two messages."""

    items: list[Item]
    step: OpenStep
    replies: list[ServerOutput]  # per item: sent again for a copy of its batch
    buffers: dict[str, torch.Tensor]  # the replica's buffers before the forward
    deadline: float
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # by item index
    # By item index: the TailGradient's delivery (None: it was held on arrival, an orphan).
    tails: dict[int, Delivery | None] = field(default_factory=dict)

    def index(self, client: str, seq: int) -> int | None:
        for at, item in enumerate(self.items):
            if item.batch.client == client and item.batch.seq == seq:
                return at
        return None


@dataclass(frozen=True)
class Backward:
    """How an open step ended. `poisoned` non-empty: roll back, these were the culprits
    (`error`: the backward's own failure, else a non-finite gradient); otherwise `present`
    were applied with their input gradients `grads`, `missing` had no tail gradient."""

    started: float
    present: list[Item] = field(default_factory=list)
    grads: StepResults = field(default_factory=list)
    missing: list[Item] = field(default_factory=list)
    poisoned: list[Item] = field(default_factory=list)
    error: Exception | None = None


class UShapedStep:
    """One shard's open step, if any, and the tail gradients that came before their batch.
    `hold` keeps a delivery to ack with the runner's next checkpoint."""

    def __init__(self, io: ShardIO, hold: Callable[[Delivery], None]) -> None:
        self._io = io
        self._hold = hold
        self._open: Open | None = None
        self._orphans: OrderedDict[tuple[str, int], TailGradient] = OrderedDict()

    @property
    def is_open(self) -> bool:
        return self._open is not None

    def held(self) -> int:
        """Batches forwarded but not applied yet."""
        return len(self._open.items) if self._open is not None else 0

    def deadline(self) -> float | None:
        return self._open.deadline if self._open is not None else None

    def buffers(self) -> dict[str, torch.Tensor] | None:
        """The replica's buffers before the open forward (None: no step is open)."""
        return self._open.buffers if self._open is not None else None

    def clear(self) -> None:
        """The replica went back to its checkpoint: the open step and the orphans are void."""
        self._open = None
        self._orphans.clear()

    def item(self, client: str, seq: int) -> Item | None:
        """The open step's batch `seq` of `client`."""
        step = self._open
        at = step.index(client, seq) if step is not None else None
        return step.items[at] if step is not None and at is not None else None

    # --- the forward half ---------------------------------------------------------------------
    def forward(self, replica: Replica, items: list[Item], weights: Sequence[float]) -> bool:
        """Open a step on `items`: the server's outputs go to the clients, the graph stays.
        False: an output is not finite (the replica is poisoned). `ForwardFailedError`: the
        strategy's forward raised."""
        io, server = self._io, replica.server
        buffers = {n: b.detach().clone() for n, b in server.named_buffers()}
        try:
            step = io.server_side.forward(server, [i.batch.activations for i in items], weights)
        except Exception as exc:
            load_partial(server, buffers)
            raise ForwardFailedError(exc) from exc
        if not all(all_finite(out.detach()) for out in step.outputs):
            return False
        replies = [
            ServerOutput(
                job=i.batch.job,
                client=i.batch.client,
                message_id=new_message_id(),
                version=replica.version,
                seq=i.batch.seq,
                activations=io.plane.host(out, i.batch.activations.dtype),
            )
            for i, out in zip(items, step.outputs, strict=True)
        ]
        deadline = io.clock() + io.limits.step_timeout_s
        self._open = Open(items, step, replies, buffers, deadline)
        for at, (item, reply) in enumerate(zip(items, replies, strict=True)):
            self._send_output(reply)
            orphan = self._orphans.pop((item.batch.client, item.batch.seq), None)
            if orphan is not None:
                self._take_tail(at, None, orphan)
        return True

    def resend(self, delivery: Delivery, batch: SmashedBatch) -> None:
        """A copy of an open step's batch: the client missed its ServerOutput (replies are
        transient). The copy's delivery takes the item's place; the caller holds the older."""
        step = self._open
        at = step.index(batch.client, batch.seq) if step is not None else None
        assert step is not None and at is not None
        step.items[at] = Item(delivery, step.items[at].batch)
        self._send_output(replace(step.replies[at], message_id=new_message_id()))

    def _send_output(self, reply: ServerOutput) -> None:
        io = self._io
        if io.replier.publish(reply, reply_routing_key(reply.job, reply.client), later=True):
            io.stats.replies += 1
        else:
            io.stats.replies_undeliverable += 1

    # --- tail gradients -----------------------------------------------------------------------
    def take(self, delivery: Delivery, message: TailGradient) -> bool:
        """A valid TailGradient: whether it belongs to the open step (then try `backward`).
        One whose batch is not forwarded here (yet) is held as an orphan: behind its batch after
        a take-over, or lost and to be republished by the client. Acked with the next
        checkpoint; if the batch never comes, the client's republish brings both again."""
        at = self._open.index(message.client, message.seq) if self._open is not None else None
        if at is None:
            self._hold(delivery)
            self._orphans[(message.client, message.seq)] = message
            while len(self._orphans) > _ORPHANS:
                self._orphans.popitem(last=False)
            return False
        self._take_tail(at, delivery, message)
        return True

    def _take_tail(self, at: int, delivery: Delivery | None, message: TailGradient) -> None:
        step = self._open
        assert step is not None
        shape = list(step.replies[at].activations.shape)
        if list(message.grad.shape) != shape:
            detail = f"tail gradient of shape {list(message.grad.shape)} for an output of {shape}"
            if delivery is not None:
                self._io.refuse(delivery, f"bad_shape: {detail}")
            return
        older = step.tails.get(at)
        if older is not None:  # a copy: the newer delivery is the one to ack with the step
            self._io.stats.duplicates_skipped += 1
            self._hold(older)
        step.tails[at] = delivery
        step.grads[at] = message.grad

    # --- the backward half --------------------------------------------------------------------
    def due(self) -> bool:
        """The open step has waited its timeout for tail gradients."""
        return self._open is not None and self._io.clock() >= self._open.deadline

    def backward(self, replica: Replica, *, force: bool) -> Backward | None:
        """The backward half, once every batch's tail gradient is in (`force`: with those that
        are; a batch without one is never applied). None: no step ends now."""
        step = self._open
        if step is None or (len(step.grads) < len(step.items) and not force):
            return None
        self._open = None
        started = time.perf_counter()
        grads = [step.grads.get(at) for at in range(len(step.items))]
        present = [item for at, item in enumerate(step.items) if at in step.grads]
        missing = [item for at, item in enumerate(step.items) if at not in step.grads]
        results: list[torch.Tensor | None] = []
        if present:
            try:
                results = backward_open(replica.optimizer, step.step, grads)
            except Exception as exc:
                return Backward(started, poisoned=step.items, error=exc)
            if not all(all_finite(g) for g in results if g is not None):
                return Backward(started, poisoned=present)
        else:
            load_partial(replica.server, step.buffers)  # as if never forwarded
        for delivery in step.tails.values():
            if delivery is not None:
                self._hold(delivery)
        dz: StepResults = [(g, 0.0, 0) for g in results if g is not None]
        return Backward(started, present, dz, missing)

    def turn_away(self, missing: list[Item], version: int) -> None:
        """Answer "rejected" the batches a forced backward went on without."""
        timeout = self._io.limits.step_timeout_s
        for item in missing:
            self._hold(item.delivery)
            reason = f"no tail gradient within {timeout:g} s: the step went on without it"
            self._io.replier.send(answer(item.batch, version, "rejected", reason))
