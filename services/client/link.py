"""The client's broker handle (`ClientLink`) and a round's `SmashedChannel` over it
(`BrokerChannel`): SmashedBatch out to the shard, GradientReply back.

Only the client's own thread calls a `ClientLink` (a pika connection is not thread-safe);
heartbeats have a thread and handle of their own (`services.client.beat`). Every wait watches
the stop event. Every delivery is judged once, in `ClientLink.poll` (docs/reliability.md, "Bad
input", the client rows); replies are matched by seq, and unanswered batches republished
(docs/architecture.md, "Conventions the roles share"). A U-shaped job's channel trades four
messages per step instead (docs/architecture.md, "U-shaped split"): SmashedBatch without
labels out, ServerOutput back, TailGradient out, GradientReply back.
"""

from __future__ import annotations

import logging
import random
import threading
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch

from broker.codec import decode, encode
from broker.errors import (
    BackPressureError,
    BrokerError,
    DecodeError,
    EncodeError,
    MessageTooLargeError,
    UnroutableError,
)
from broker.messages import (
    Error,
    GradientReply,
    InferReply,
    Leave,
    Message,
    ServerOutput,
    SmashedBatch,
    TailGradient,
    WeightsAssignment,
    Welcome,
    new_message_id,
)
from broker.rejection import Rejected, ack_safely, dead_letter_safely
from broker.topology import (
    CONTROL_EXCHANGE,
    SMASHED_EXCHANGE,
    shard_routing_key,
)
from broker.transport import Backoff, Broker, Delivery, PublishOptions, QueueSpec
from models.split import SplitNet
from services.algorithms.staleness import TOO_STALE
from services.client.beat import Heartbeats, StartBeats
from services.client.errors import (
    ClientError,
    ClientStopped,
    RoundAborted,
    StaleWeights,
    Superseded,
)
from services.client.plan import RoundPlan, config_int
from services.client.stats import ClientStats

# What may arrive on a client's reply queue; anything else is dead-lettered.
REPLY_TYPES = (Welcome, WeightsAssignment, GradientReply, ServerOutput, Error, InferReply)
REPLY_PREFETCH = 16
# Longest single broker wait, so a stop is never held up for long.
MAX_POLL_S = 0.25
# For refused publishes. Equal jitter (never under half the cap): retries stay spaced out, yet
# clients refused together do not retry in lockstep.
_BACKOFF = Backoff(initial=0.05, cap=2.0)


class Tagged(logging.LoggerAdapter[logging.Logger]):
    """A client's logger: each line starts with its job and client."""

    def __init__(self, logger: logging.Logger, job: str, client: str) -> None:
        super().__init__(logger)
        self._tag = f"job {job} client {client}: "

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        return self._tag + str(msg), kwargs


class ClientLink:
    def __init__(
        self,
        broker: Broker,
        *,
        job: str,
        client: str,
        stats: ClientStats,
        stop: threading.Event,
        clock: Callable[[], float],
        logger: logging.Logger,
        heartbeat_s: float,
        route_wait_s: float = 60.0,
        rng: random.Random | None = None,
        reply_timeout_s: float = 30.0,
        max_republish: int = 5,
        seq_start: int | None = None,
        model: SplitNet,
        plan: RoundPlan,
        heartbeats: StartBeats | None = None,
        reply: QueueSpec | None = None,
    ) -> None:
        """`model` and `plan` (the client's own settings) judge Welcomes and assignments.
        `seq_start`: the session's first seq, if known before its Welcome (`begin`).
        `heartbeats` makes the member's heartbeats (`start_heartbeats`). `reply` is the
        client's own reply queue, declared and consumed by `open`; None for a client host's
        client, whose replies reach `broker` through the host's queue (docs/architecture.md,
        "Client hosts")."""
        self._broker = broker
        self.job = job
        self.client = client
        self.stats = stats
        self._stop = stop
        self.clock = clock
        self.log = Tagged(logger, job, client)
        self._heartbeat_s = heartbeat_s
        self._route_wait_s = route_wait_s
        self._rng = rng or random.Random()
        self.reply_timeout_s = reply_timeout_s
        self.max_republish = max_republish
        # The session's seqs run from its Welcome's `seq_base` on, one per batch, across
        # rounds: a reply at or past `next_seq` answers nothing sent, one below `seq_base` is a
        # previous process's. None before the Welcome: nothing is sent yet.
        self.seq_base = seq_start
        self.next_seq = seq_start or 0
        self.unawaited: set[int] = set()  # seqs sent without waiting (local-loss algorithms)
        self._model = model
        self._plan = plan
        self._heartbeats = heartbeats
        self._reply = reply
        self._deferred: deque[Message] = deque()
        self._beat: Heartbeats | None = None  # None: not a member yet, no heartbeats
        self._next_keep_alive = 0.0
        # The latest weights version this client knows; the heartbeat thread reads it (an int
        # attribute: its reads and writes are atomic).
        self.version = 0
        self.io_s = 0.0  # time spent blocked on the broker (publishing, waiting, backing off)

    # --- set-up ---------------------------------------------------------------------------------

    def open(self) -> None:
        if self._reply is not None:
            self._broker.declare([self._reply])
            self._broker.subscribe(self._reply.name, prefetch=REPLY_PREFETCH)

    def begin(self, seq_base: int) -> None:
        """Number the batches from a Welcome's `seq_base` on. Another Welcome of the session
        repeats its base; one after the member's record expired (answered `unknown_member`,
        joined again) brings a higher one, chosen above every seq sent, and the batches go on
        from there. A lower one (an older Welcome, late) changes nothing: seqs never go back."""
        if self.seq_base is None or seq_base > self.seq_base:
            self.seq_base = seq_base
            self.next_seq = max(self.next_seq, seq_base)

    def start_heartbeats(self) -> None:
        """Start beating (once a member) until `leave`."""
        if self._beat is not None:
            return
        if self._heartbeats is None:
            raise ValueError("this link has no heartbeats")
        self._beat = self._heartbeats(lambda: self.version)
        self._beat.start()

    # --- publishing -----------------------------------------------------------------------------

    def send(self, routing_key: str, message: Message) -> None:
        """Encode and publish `message` to the control exchange (retrying while refused)."""
        self.publish(CONTROL_EXCHANGE, routing_key, encode(message), message_id=message.message_id)

    def publish(self, exchange: str, routing_key: str, body: bytes, *, message_id: str) -> None:
        """Publish, sleeping with backoff while the queue is full or not declared yet (the
        service side has not started); after `route_wait_s` of that, a `ClientError`."""
        attempt = 0
        unroutable_since: float | None = None
        while True:
            self._check_stop()
            started = self.clock()
            try:
                self._broker.publish(exchange, routing_key, body, PublishOptions(message_id))
                self.stats.bytes_up += len(body)
                return
            except BackPressureError:
                self.stats.backpressure_retries += 1
                self.log.debug("%s refused (queue full), backing off", routing_key)
            except UnroutableError as exc:
                self.stats.unroutable_retries += 1
                unroutable_since = started if unroutable_since is None else unroutable_since
                if started - unroutable_since >= self._route_wait_s:
                    raise ClientError(
                        f"job {self.job}, client {self.client}: nothing consumes {exchange} / "
                        f"{routing_key} after {self._route_wait_s:.0f} s ({exc}); is the "
                        "service side of the job running?"
                    ) from None
            finally:
                self.io_s += self.clock() - started
            started = self.clock()
            self._stop.wait(_BACKOFF.delay(attempt, self._rng))  # a stop raises at the top
            self.io_s += self.clock() - started
            attempt += 1

    def keep_alive(self) -> None:
        """Between local steps that never touch the broker (whole-model algorithms): every
        `heartbeat_s`, one cheap round trip on this handle, so that RabbitMQ does not drop an
        idle connection (AMQP heartbeats are only serviced while the handle is called)."""
        now = self.clock()
        if self._reply is None or now < self._next_keep_alive:
            return  # a client host keeps its own connections serviced
        self._next_keep_alive = now + self._heartbeat_s
        self._broker.queue_depth(self._reply.name)

    def leave(self, reason: str) -> None:
        """Best effort: a client that cannot say goodbye is dropped by heartbeat expiry."""
        beat, self._beat = self._beat, None
        if beat is None:
            return
        # Heartbeats end first: one behind the Leave would find no member.
        if not beat.stop():
            self.log.warning("heartbeat thread still publishing at leave")
        self.stats.heartbeats_sent += beat.sent
        self.stats.bytes_up += beat.bytes_sent
        message = Leave(self.job, self.client, new_message_id(), self.version, reason=reason)
        try:
            body = encode(message)
            options = PublishOptions(message.message_id)
            self._broker.publish(CONTROL_EXCHANGE, self.job, body, options)
            self.stats.bytes_up += len(body)
        except ClientStopped:
            pass  # a client host's client gone offline: it leaves no word, as a device would
        except BrokerError as exc:
            self.log.warning("could not send Leave (%s): %s", reason, exc)

    # --- receiving ------------------------------------------------------------------------------

    def defer(self, message: Message, *, first: bool = False) -> None:
        """Keep a reply for the main loop (e.g. an assignment that arrives mid-round)."""
        if first:
            self._deferred.appendleft(message)
        else:
            self._deferred.append(message)

    def poll(
        self, timeout: float, *, deferred: bool = False, awaiting: SmashedBatch | None = None
    ) -> Message | None:
        """The next valid reply within `timeout` seconds (deferred ones first when `deferred`);
        invalid ones are dead-lettered. An invalid answer to `awaiting` (ok, without a gradient
        of its batch's shape; a ServerOutput of the wrong shape) raises `RoundAborted`: the
        caller cannot go on without it."""
        if deferred and self._deferred:
            return self._deferred.popleft()
        started = self.clock()
        end = started + timeout
        try:
            while True:
                self._check_stop()
                delivery = self._broker.get(min(max(0.0, end - self.clock()), MAX_POLL_S))
                if delivery is not None:
                    message = self._accept(delivery, awaiting)
                    if message is not None:
                        return message
                if self.clock() >= end:
                    return None
        finally:
            self.io_s += self.clock() - started

    def took_late(self, reply: GradientReply) -> bool:
        """Whether `reply` is a late answer to a batch sent without waiting (counted as a
        reply), else a duplicate (counted as dropped)."""
        if reply.seq in self.unawaited:
            self.unawaited.discard(reply.seq)
            self.stats.replies_received += 1
            return True
        self.stats.duplicates_dropped += 1
        return False

    def _accept(self, delivery: Delivery, awaiting: SmashedBatch | None) -> Message | None:
        self.stats.bytes_down += len(delivery.body)
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            self._refuse(delivery, f"undecodable: {exc.reason}")
            return None
        reason = self._problem(message)
        if reason is None and awaiting is not None:
            if isinstance(message, GradientReply):
                reason = _gradient_problem(message, awaiting)
            elif isinstance(message, ServerOutput):
                reason = _output_problem(message, awaiting, self._model)
            if reason is not None:  # the answer the caller waits for: it cannot go on
                self._refuse(delivery, reason)
                raise RoundAborted(reason)
        if reason is not None:
            self._refuse(delivery, reason)
            return None
        if not ack_safely(self._broker, delivery):
            return None  # its connection is gone: it comes back, and is taken then
        return message

    def _problem(self, message: Message) -> str | None:
        """Why `message` cannot be a reply to this client, or None."""
        kind = type(message).__name__
        if not isinstance(message, REPLY_TYPES):
            return f"{kind} does not belong on a client's reply queue"
        if message.job != self.job:
            return f"{kind} for job {message.job!r} on a queue of job {self.job!r}"
        if message.client != self.client:
            return f"{kind} for client {message.client!r} on the queue of {self.client!r}"
        if isinstance(message, GradientReply | ServerOutput):
            # An earlier seq may be a late copy of an answer already taken, or a previous
            # run's (every one before the Welcome): a duplicate, not an invalid message.
            if self.seq_base is not None and message.seq >= self.next_seq:
                return (
                    f"{kind} for seq {message.seq}, never sent by this client "
                    f"(its next seq is {self.next_seq})"
                )
            return None
        if isinstance(message, Welcome | WeightsAssignment):
            return self._fit_problem(message)
        return None

    def _fit_problem(self, message: Welcome | WeightsAssignment) -> str | None:
        if isinstance(message, WeightsAssignment) and not message.participate:
            return None
        kind = type(message).__name__
        try:
            self._plan.updated(message.config)
            config_int(message.config, "partition")
            config_int(message.config, "shard")
            if isinstance(message, Welcome):
                self._model.cut_index(message.cut)
        except ValueError as exc:  # ModelSpecError included
            return f"{kind}: {exc}"
        own = self._model.state_dict()
        for weights in (message.client_weights, message.aux_weights):
            for name, tensor in weights.items():
                if name not in own:
                    return f"{kind}: unknown tensor {name!r} for this model"
                if tensor.shape != own[name].shape:
                    return (
                        f"{kind}: {name}: shape {list(tensor.shape)}, the model has "
                        f"{list(own[name].shape)}"
                    )
        return None

    def _refuse(self, delivery: Delivery, reason: str) -> None:
        if dead_letter_safely(self._broker, delivery, reason) is Rejected.REDELIVERED:
            return  # its connection is gone: it comes back and is judged again
        self.stats.dead_lettered += 1
        self.log.warning("dead-lettering a reply: %s", reason)

    def _check_stop(self) -> None:
        if self._stop.is_set():
            raise ClientStopped("stop requested")


def _gradient_problem(reply: GradientReply, batch: SmashedBatch) -> str | None:
    """Why `reply` cannot answer `batch`, when it is the answer (an ok one) to it."""
    if reply.seq != batch.seq or reply.status != "ok":
        return None
    shape = batch.activations.shape
    if reply.grad is not None and reply.grad.shape == shape:
        return None
    got = None if reply.grad is None else list(reply.grad.shape)
    return f"GradientReply seq {reply.seq}: gradient shape {got}, expected {list(shape)}"


def _output_problem(output: ServerOutput, batch: SmashedBatch, model: SplitNet) -> str | None:
    """Why `output` cannot be the server's output for `batch`, when it answers it."""
    if output.seq != batch.seq:
        return None
    got = list(output.activations.shape)
    want: list[int] = [int(batch.activations.shape[0])]
    if model.tail is not None:
        want += model.server_output_shape()
    elif got[:1] == want:  # a model without a tail has no output shape: only the rows count
        return None
    if got == want:
        return None
    return f"ServerOutput seq {output.seq}: shape {got}, expected {want}"


@dataclass
class Tally:
    """Training loss/accuracy as the worker reports it (or the client measures it)."""

    loss_sum: float = 0.0
    correct: int = 0
    samples: int = 0

    def add(self, loss: float, correct: int, samples: int) -> None:
        self.loss_sum += loss * samples
        self.correct += correct
        self.samples += samples

    def metrics(self) -> dict[str, float]:
        if not self.samples:
            return {}
        return {
            "train_loss": self.loss_sum / self.samples,
            "train_accuracy": self.correct / self.samples,
        }


class BrokerChannel:
    """One round's `SmashedChannel` (services.algorithms.base): SmashedBatch out to the shard,
    GradientReply back."""

    def __init__(
        self,
        link: ClientLink,
        assignment: WeightsAssignment,
        *,
        shard: int,
        cut: str,
        wire_dtype: torch.dtype,
    ) -> None:
        self._link = link
        self._round = assignment.round
        self._version = assignment.version
        self._shard = shard
        self._cut = cut  # where the client's activations come from (its Welcome's cut)
        self._wire_dtype = wire_dtype
        self._routing_key = shard_routing_key(link.job, shard)
        self.tally = Tally()
        # U-shaped: the batch whose ServerOutput came back and whose tail gradient is due.
        self._forwarded: tuple[SmashedBatch, bytes] | None = None

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, y, step, steps)
        return self._await(batch, [(body, batch.message_id)])

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        batch, _ = self._publish(z, y, step, steps)
        self._link.unawaited.add(batch.seq)

    def forward(self, z: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        batch, body = self._publish(z, None, step, steps)
        self._forwarded = (batch, body)
        return self._await(batch, [(body, batch.message_id)], output=True)

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._forwarded is None:
            raise RuntimeError("backward without a forward: nothing awaits a tail gradient")
        (batch, body), self._forwarded = self._forwarded, None
        link = self._link
        tail = TailGradient(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=self._version,
            seq=batch.seq,
            shard=self._shard,
            round=self._round,
            grad=grad.detach().to(device="cpu", dtype=self._wire_dtype),
        )
        try:
            tail_body = encode(tail)
        except EncodeError as exc:  # a non-finite loss: the tail diverged
            raise RoundAborted(f"step {batch.step}: cannot send the tail gradient: {exc}") from None
        link.publish(SMASHED_EXCHANGE, self._routing_key, tail_body, message_id=tail.message_id)
        # Unanswered, both go again: a worker that took the shard over may lack the forward.
        copies = [(body, batch.message_id), (tail_body, tail.message_id)]
        return self._await(batch, copies, tally=False)

    def _publish(
        self, z: torch.Tensor, y: torch.Tensor | None, step: int, steps: int
    ) -> tuple[SmashedBatch, bytes]:
        link = self._link
        batch = SmashedBatch(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=self._version,
            seq=link.next_seq,
            shard=self._shard,
            round=self._round,
            step=step,
            steps=steps,
            activations=z.detach().to(device="cpu", dtype=self._wire_dtype),
            labels=None if y is None else y.detach().to(device="cpu", dtype=torch.int64),
            cut=self._cut,
        )
        link.next_seq += 1
        try:
            body = encode(batch)
        except EncodeError as exc:  # non-finite activations: the local model diverged
            raise RoundAborted(f"step {step}: cannot send smashed data: {exc}") from None
        try:
            link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=batch.message_id)
        except MessageTooLargeError as exc:
            raise ClientError(
                f"job {link.job} client {link.client}: one smashed batch is {len(body)} bytes, "
                f"more than the broker takes ({exc}); lower algorithm.batch_size, use "
                "smashed_dtype float16, or raise broker.max_message_bytes with the server limit"
            ) from None
        link.stats.batches_sent += 1
        return batch, body

    def _await(
        self,
        batch: SmashedBatch,
        copies: list[tuple[bytes, str]],
        *,
        output: bool = False,
        tally: bool = True,
    ) -> torch.Tensor:
        """The gradient for `batch` (`output`: the server's output for it, U-shaped), with
        `copies` (body, message id) published again while it does not come."""
        link = self._link
        deadline = link.clock() + link.reply_timeout_s
        republished = 0
        while True:
            message = link.poll(max(0.0, deadline - link.clock()), awaiting=batch)
            if isinstance(message, ServerOutput):
                if output and message.seq == batch.seq:
                    link.stats.replies_received += 1
                    return message.activations
                link.stats.duplicates_dropped += 1  # e.g. a redelivered batch's forward
            elif isinstance(message, GradientReply):
                grad = self._on_reply(message, batch, tally=tally)
                if grad is not None and output:
                    raise RoundAborted(f"seq {batch.seq}: a gradient before its tail gradient")
                if grad is not None:
                    return grad
            elif message is not None:
                self._on_other(message, batch)
            elif link.clock() >= deadline:
                if republished >= link.max_republish:
                    raise RoundAborted(
                        f"round {self._round + 1}: no gradient for seq {batch.seq} after "
                        f"{republished + 1} tries of {link.reply_timeout_s:.1f} s"
                    )
                republished += 1
                link.stats.republished += 1
                link.log.warning(
                    "no gradient for seq %d (round %d step %d) after %.1f s; publishing it again",
                    batch.seq,
                    batch.round + 1,
                    batch.step,
                    link.reply_timeout_s,
                )
                for body, message_id in copies:
                    link.publish(SMASHED_EXCHANGE, self._routing_key, body, message_id=message_id)
                deadline = link.clock() + link.reply_timeout_s

    def _on_reply(
        self, reply: GradientReply, batch: SmashedBatch, *, tally: bool = True
    ) -> torch.Tensor | None:
        """The gradient of an ok answer to `batch`; `tally`: count the worker's loss (a
        U-shaped step's loss is the client's own)."""
        if reply.seq != batch.seq:
            if self._link.took_late(reply):
                if reply.status == "ok":
                    self.tally.add(reply.loss, reply.correct, reply.samples)
            else:
                self._link.log.debug(
                    "dropped GradientReply seq %d (awaiting %d)", reply.seq, batch.seq
                )
            return None
        if reply.status == "stale":
            # Held (e.g. in MiniBatch-SFL's step barrier): its real answer is on the way.
            self._link.stats.stale_replies += 1
            return None
        if reply.status == "ok":
            self._link.stats.replies_received += 1
            if tally:
                self.tally.add(reply.loss, reply.correct, reply.samples)
            assert reply.grad is not None  # the link refused an ok reply without one
            return reply.grad
        where = f"round {self._round + 1} step {batch.step}: shard {self._shard}"
        if reply.status == "gone":
            # Applied, its gradient lost: no wait brings it, and every algorithm that waits
            # needs it, so the round ends here (and says so at once).
            self._link.stats.gone_replies += 1
            raise RoundAborted(
                f"{where} applied seq {batch.seq}, its gradient is gone: "
                f"{reply.reason or 'no reason'}"
            )
        if reply.status == "rejected" and reply.reason.startswith(TOO_STALE):
            raise StaleWeights(f"round {self._round + 1}: {reply.reason}")
        raise RoundAborted(
            f"{where} answered seq {batch.seq} with status {reply.status!r}: "
            f"{reply.reason or 'no reason'}"
        )

    def _on_other(self, message: Message, batch: SmashedBatch) -> None:
        """Replies for the main loop wait; one that ends this round ends it now."""
        self._link.defer(message)
        if isinstance(message, WeightsAssignment) and (
            message.round > self._round or not message.participate
        ):
            raise Superseded(
                f"round {self._round + 1} superseded by an assignment for round {message.round + 1}"
            )
        if isinstance(message, Error) and message.ref_message_id == batch.message_id:
            raise RoundAborted(f"seq {batch.seq} refused: {message.code}: {message.reason}")
