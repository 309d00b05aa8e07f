"""An edge client (architecture steps 2, 4, 7): join, train, leave.

Sync and async jobs (docs/async.md, "The protocol") run one loop; the Welcome picks its clock
(`Rounds`, `Newest`, `Idle`). A dropped round is said with a `RoundDropped`
(docs/reliability.md, "Liveness").
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import KW_ONLY, InitVar, dataclass, replace
from functools import partial

import torch
from torch import nn

from broker.errors import EncodeError
from broker.messages import (
    ABORTED,
    NON_FINITE,
    ConfigValue,
    Error,
    GradientReply,
    Join,
    Message,
    RoundDropped,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.topology import updates_routing_key
from broker.transport import QueueSpec
from models.split import SplitNet, evaluating
from models.state import load_partial
from services.algorithms.base import ClientContext, LocalRound, Strategy
from services.algorithms.recipe import LossFn
from services.algorithms.registry import build_strategy
from services.client.beat import HeartbeatThread
from services.client.data import JobData, client_batches, round_batches
from services.client.errors import (
    ClientError,
    ClientSettingsError,
    ClientStopped,
    JoinRejectedError,
    JoinTimeoutError,
    RoundAborted,
    StaleWeights,
    Superseded,
)
from services.client.lending import ComputeGate, KeptMemory, OwnModel, Seat
from services.client.link import BrokerChannel, ClientLink, Tally
from services.client.plan import RoundPlan, config_int
from services.client.secured import secured_client_broker
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from services.data.batches import Batch
from services.data.loaders import Dataset
from services.security.hidden import client_reply_queue, queue_secret
from services.security.identity import CLIENT_ID

EVAL_CHUNK = 512
# The codec's wording for a tensor holding NaN or infinities (broker/codec.py), which is how a
# diverged model shows: in its weights (the update) or its activations (a smashed batch).
_NON_FINITE_WORDS = "NaN or infinite"
# Enough of the exception's text for an operator's log; the reason kind is what counts.
_DETAIL_CHARS = 300


def drop_reason(exc: Exception) -> str:
    """`non_finite` when the local model diverged, else `aborted`."""
    return NON_FINITE if _NON_FINITE_WORDS in str(exc) else ABORTED


def drop_notice(
    job: str, client: str, assignment: WeightsAssignment, exc: Exception
) -> RoundDropped:
    return RoundDropped(
        job=job,
        client=client,
        message_id=new_message_id(),
        version=assignment.version,
        round=assignment.round,
        reason=drop_reason(exc),
        ref_message_id=assignment.message_id,
        detail=str(exc)[:_DETAIL_CHARS],
    )


class Rounds:
    """Sync rounds: train each round a WeightsAssignment names, once."""

    patience_s = math.inf  # assignments come when the round opens: wait for them
    ask = False

    def __init__(self) -> None:
        self._last = -1
        # The assignment whose round this client dropped last (None: it uploaded that round).
        # The aggregator reopens a round that got no valid update with a new assignment for the
        # same round: a dropped round is tried again then, an uploaded one only if the upload
        # came after its round had closed (answered `round_closed`).
        self._dropped: str | None = None
        self._uploaded: str | None = None  # the assignment whose round was uploaded last

    def take(self, message: Message) -> WeightsAssignment | None:
        """The round to train that `message` hands out, or None."""
        if not isinstance(message, WeightsAssignment) or not message.participate:
            return None
        if message.round < self._last:
            return None
        retry = self._dropped is not None and message.message_id != self._dropped
        if message.round == self._last and not retry:
            return None  # a copy of an assignment already handled, or an uploaded round
        self._last = message.round
        return message

    def done(self, assignment: WeightsAssignment, *, uploaded: bool) -> None:
        self._dropped = None if uploaded else assignment.message_id
        self._uploaded = assignment.message_id if uploaded else None

    def closed_before_upload(self) -> None:
        """The aggregator answered an upload `round_closed`: it was not counted, so a reopened
        attempt at that round is tried again, as after a drop (were the answer about an older
        round, a later one is reopened only if no update of it counted: ours neither)."""
        if self._uploaded is not None:
            self._dropped, self._uploaded = self._uploaded, None


class Idle(Rounds):
    """Async mode for a member whose partition holds no training samples: it trains nothing and
    stays a member until dismissed (docs/async.md, "The protocol": why)."""

    def take(self, message: Message) -> WeightsAssignment | None:
        return None


class Newest:
    """Async mode (docs/async.md, "The protocol"): local rounds numbered by the client, never
    below an assignment's; one answers no real assignment, so its `RoundDropped` refers to none."""

    def __init__(self, patience_s: float) -> None:
        self.patience_s = patience_s  # for the answer to an upload: then ask again
        self.ask = False  # nothing was uploaded, so nothing will be answered unless we ask
        self._local = 0

    def take(self, message: Message) -> WeightsAssignment | None:
        if isinstance(message, Welcome):
            w = message
            message = WeightsAssignment(
                w.job, w.client, "", w.version, 0, True, w.client_weights, w.aux_weights, w.config
            )
        elif not isinstance(message, WeightsAssignment) or not message.participate:
            return None
        self._local = max(self._local, message.round)
        return replace(message, message_id="", round=self._local)

    def done(self, assignment: WeightsAssignment, *, uploaded: bool) -> None:
        self._local += 1
        self.ask = not uploaded


Clock = Rounds | Newest


@dataclass(eq=False)
class Client:
    settings: Settings
    backends: Backends
    _: KW_ONLY
    client_id: str
    partition: int | None = None
    dataset: InitVar[Dataset | JobData | None] = None
    join_retry_s: float = 5.0
    join_give_up_s: float = 120.0
    max_republish: int = 5
    # A client host's client runs on a seat it lends (services/client/host.py); None: the
    # client opens its own connections and keeps its own model.
    seat: Seat | None = None
    # Shared by clients of one process that compete for its cores (an embedded run); None:
    # the client computes whenever it likes (a process of its own). A seat brings its own.
    compute: ComputeGate | None = None

    def __post_init__(self, dataset: Dataset | JobData | None) -> None:
        count = self.settings.clients.count
        if not CLIENT_ID.match(self.client_id):  # it becomes part of queue names and keys
            raise ClientSettingsError(
                f"client id {self.client_id!r}: use 1-64 letters, digits, '_' or '-' (--id)"
            )
        if self.partition is not None and not 0 <= self.partition < count:
            raise ClientSettingsError(
                f"partition {self.partition} outside 0..{count - 1}: the job has "
                f"{count} clients (--partition, clients.count)"
            )
        self._data = dataset if isinstance(dataset, JobData) else JobData(self.settings, dataset)
        self._job = self.settings.job.name
        self._session = new_message_id()  # renewed by each run()
        self._join_info: Mapping[str, str] = {}

    def run(self, stop: threading.Event) -> ClientStats:
        """Join, train every assigned round, leave; returns when the job finishes or on stop.
        `ClientError`: the client cannot take part at all (no Welcome, no data, no service)."""
        stats = ClientStats()
        # Every Join of this run names it: a run after a leave, or a restart after a crash,
        # is another process to the aggregator (it drops the old one from an open round).
        self._session = new_message_id()
        settings, name = self.settings, f"splitmq-client-{self.client_id}"
        seat = self.seat or self._own_seat(name)
        self._join_info = seat.join_info
        link = ClientLink(
            seat.broker,
            job=self._job,
            client=self.client_id,
            stats=stats,
            stop=stop,
            clock=time.monotonic,
            logger=logging.getLogger("splitmq.client"),
            heartbeat_s=settings.clients.heartbeat_s,
            reply_timeout_s=settings.clients.reply_timeout_s,
            max_republish=self.max_republish,
            model=seat.models.reference,  # its weights come from the service, not the seed
            plan=RoundPlan.from_settings(settings),
            heartbeats=seat.heartbeats,
            reply=None if self.seat else self.reply_queue(),
        )
        reason = "finished"
        try:
            link.open()
            # The first optimizer of a process imports torch._dynamo: seconds of CPU. Pay for
            # it before joining, not inside the first round, where it would make a newly
            # joined client miss a tight round deadline.
            job_hyper(settings).client_optimizer(seat.models.reference.parameters())
            joined = self._join(link)
            if joined is not None:
                runner = RoundRunner(
                    link, seat, self._data, settings.job.seed, settings.evaluation.enabled
                )
                self._serve(link, runner, *joined)
        except ClientStopped:
            reason = "stopped"
        except BaseException as exc:
            reason = f"failed: {exc}"[:200]
            raise
        finally:
            link.leave(reason)
            seat.broker.close()
        # The batch count is what compose/smoke.sh checks against the shards' applied counts;
        # benchmarks/backpressure_memory.py sums the refusals.
        link.log.info(
            "%s after %d rounds, %d batches sent, %d back-pressure refusals",
            reason,
            stats.rounds,
            stats.batches_sent,
            stats.backpressure_retries,
        )
        return stats

    def reply_queue(self) -> QueueSpec:
        """A standalone client's reply queue: in the secured mode under the name its password
        hides (services/security/hidden.py), which only it and its provisioner know."""
        per_client_users = self.settings.security.per_client_users
        secret = queue_secret(per_client_users, self.backends.broker_settings.amqp_url)
        return client_reply_queue(self._job, self.client_id, secret)

    def _own_seat(self, name: str) -> Seat:
        """A standalone client's connections, heartbeat thread and one model."""
        settings, backends, client = self.settings, self.backends, self.client_id
        return Seat(
            broker=secured_client_broker(settings, backends, client, name),
            # A thread and connection of their own (services/client/beat.py).
            heartbeats=partial(
                HeartbeatThread,
                lambda: secured_client_broker(settings, backends, client, f"{name}-heartbeat"),
                job=self._job,
                client=client,
                interval_s=settings.clients.heartbeat_s,
                logger=logging.getLogger("splitmq.client"),
            ),
            models=OwnModel(job_model(settings)),
            memory=KeptMemory(),
            join_info={},
            compute=self.compute or ComputeGate(),
        )

    # --- join -------------------------------------------------------------------------------------

    def _join(self, link: ClientLink) -> tuple[Membership, Clock] | None:
        """Join until welcomed; None when the job turns out to be over already."""
        join_ids = {self._send_join(link, self.partition)}
        sent_at = link.clock()
        give_up_at = sent_at + self.join_give_up_s
        resend_at = link.clock() + self.join_retry_s
        while True:
            now = link.clock()
            if now >= give_up_at:
                raise JoinTimeoutError(
                    f"job {self._job} client {self.client_id}: no Welcome after "
                    f"{self.join_give_up_s:.0f} s ({len(join_ids)} Joins sent); is the "
                    "coordinator running?"
                )
            if now >= resend_at:
                join_ids.add(self._send_join(link, self.partition))
                resend_at = now + self.join_retry_s
            message = link.poll(min(resend_at, give_up_at) - now)
            if isinstance(message, Welcome):
                link.stats.join_s = link.clock() - sent_at
                return self._welcomed(link, message)
            if self._dismissed(link, message):
                return None
            if isinstance(message, WeightsAssignment):
                link.defer(message)  # raced ahead of the Welcome
            elif isinstance(message, Error) and message.ref_message_id in join_ids:
                raise JoinRejectedError(
                    f"job {self._job} client {self.client_id}: Join refused: "
                    f"{message.code}: {message.reason}"
                )
            elif message is not None:
                self._note(link, message)

    def _dismissed(self, link: ClientLink, message: Message | None) -> bool:
        """Whether `message` dismisses us (a `finished` assignment); notes how the job ended."""
        if not isinstance(message, WeightsAssignment) or message.config.get("finished") is not True:
            return False
        status = message.config.get("status")
        link.stats.finished = True
        # A service of an older make sends no status: its dismissal meant "finished".
        link.stats.job_status = status if isinstance(status, str) and status else "finished"
        if link.stats.job_status != "finished":  # e.g. "failed: ..." when no round could progress
            link.log.warning("the job ended: %s", link.stats.job_status)
        return True

    def _send_join(self, link: ClientLink, index: int | None) -> str:
        info = {**self._join_info, "session": self._session}
        samples = 0
        if index is not None:
            samples = len(self._data.indices(index))
            info["index"] = str(index)
            info["classes"] = ",".join(str(c) for c in self._data.classes(index))
        capability = self.settings.clients.declared_capability(index)
        join = Join(
            self._job, self.client_id, new_message_id(), link.version, samples, capability, info
        )
        link.send(self._job, join)
        link.stats.joins_sent += 1
        return join.message_id

    def _welcomed(self, link: ClientLink, welcome: Welcome) -> tuple[Membership, Clock]:
        # The coordinator's assignment wins over the index asked for: shard choice and
        # evaluation go by its record, and it may have moved a client off a taken index.
        index = config_int(welcome.config, "partition")
        if index is None:
            index = self.partition
        if index is None or index >= self.settings.clients.count:
            raise ClientError(
                f"job {self._job} client {self.client_id}: no usable data partition (Welcome "
                f"says {welcome.config.get('partition')!r}): pass one, or have the coordinator "
                "assign it"
            )
        if index != self.partition:
            if self.partition is not None:
                link.log.warning(
                    "asked for partition %d, the coordinator assigned %d", self.partition, index
                )
            # The coordinator records samples and classes from a Join: send the right ones.
            self._send_join(link, index)
        # Its weights are not loaded here: each round loads the weights it trains from
        # (an async job's first round is this Welcome's, deferred below).
        plan = RoundPlan.from_settings(self.settings).updated(welcome.config)
        link.version = welcome.version
        link.begin(welcome.seq_base)
        link.start_heartbeats()
        link.log.info(
            "welcomed at version %d: shard %d, cut %s, partition %d",
            welcome.version,
            welcome.shard,
            welcome.cut,
            index,
        )
        member = Membership(
            welcome.shard, welcome.cut, index, plan, build_strategy(plan.algorithm, plan.params)
        )
        if welcome.config.get("mode") != "async":  # the service runs the job in sync rounds
            return member, Rounds()
        if not len(self._data.indices(index)):
            link.log.warning(
                "partition %d has no training samples; not training, staying a member until "
                "the job ends",
                index,
            )
            return member, Idle()
        link.defer(welcome, first=True)  # the first local round's weights
        return member, Newest(self.settings.clients.reply_timeout_s)

    # --- rounds -----------------------------------------------------------------------------------

    def _serve(
        self, link: ClientLink, runner: RoundRunner, member: Membership, clock: Clock
    ) -> None:
        """Train what the clock hands out until the job is over (returns) or a stop (raises)."""
        while (got := self._next(link, member, clock)) is not None:
            work, member = got
            member = member.updated(work.config)
            clock.done(work, uploaded=self._round(link, runner, member, work))

    def _next(
        self, link: ClientLink, member: Membership, clock: Clock
    ) -> tuple[WeightsAssignment, Membership] | None:
        """The clock's next round, and the membership as it stands; None when the job is over.
        A clock that asks does so once nothing already here (the job's end, say) answers."""
        deadline = link.clock() + (0.0 if clock.ask else clock.patience_s)
        while True:
            message = link.poll(max(0.0, deadline - link.clock()), deferred=True)
            if message is None:  # no answer within the clock's patience: ask for one
                if not clock.ask:
                    link.log.warning("no new weights after %.0f s; asking again", clock.patience_s)
                clock.ask = False
                self._send_join(link, member.partition)
                deadline = link.clock() + clock.patience_s
                continue
            if self._dismissed(link, message):
                return None
            if isinstance(message, Welcome):
                # The answer to our own Join: shard and cut are the coordinator's record.
                member = replace(member, shard=message.shard, cut=message.cut)
                link.begin(message.seq_base)
            work = clock.take(message)
            if work is not None:
                return work, member
            if isinstance(message, Error) and message.code == "round_closed":
                if isinstance(clock, Rounds):  # async mode's refusals say too_stale
                    clock.closed_before_upload()
            if isinstance(message, Error) and message.code == "unknown_member":
                # Our membership expired (e.g. a heartbeat gap longer than the TTL): join again
                # rather than stall; the coordinator's next assignment names our shard.
                link.log.warning("membership expired, joining again")
                self._send_join(link, member.partition)
            if not isinstance(message, WeightsAssignment | Welcome):
                self._note(link, message)

    def _round(
        self, link: ClientLink, runner: RoundRunner, member: Membership, work: WeightsAssignment
    ) -> bool:
        """Train a round and upload it; False when it was dropped (and said so)."""
        link.version = work.version
        try:
            with runner.seat.models.borrow() as model:
                update = runner.run(model, member, work)
                link.send(updates_routing_key(self._job), update)
        except (EncodeError, RoundAborted) as exc:  # EncodeError: the local model diverged
            stale = isinstance(exc, StaleWeights)
            if stale:
                link.stats.stale_rounds += 1
            else:
                link.stats.rounds_aborted += 1
            # Too stale is async mode working as meant; anything else is worth a warning.
            link.log.log(
                logging.INFO if stale else logging.WARNING,
                "round %d (version %d) dropped (%s): %s",
                work.round + 1,
                work.version,
                drop_reason(exc),
                exc,
            )
            if not isinstance(exc, Superseded | StaleWeights):
                # Said at once, so the round need not wait for its deadline to learn it.
                link.send(
                    updates_routing_key(self._job),
                    drop_notice(self._job, self.client_id, work, exc),
                )
            return False
        link.stats.rounds += 1
        link.log.info(
            "round %d done at version %d: %s",
            work.round + 1,
            work.version,
            {k: round(v, 4) for k, v in update.metrics.items()},
        )
        return True

    def _note(self, link: ClientLink, message: Message) -> None:
        """Replies outside any exchange: late errors and duplicates."""
        if isinstance(message, Error):
            link.stats.errors_received += 1
            link.log.warning("error reply %s: %s", message.code, message.reason)
        elif isinstance(message, GradientReply):
            link.took_late(message)
        else:
            link.log.debug("ignoring %s", type(message).__name__)


@dataclass(frozen=True)
class Membership:
    """What the Welcome settled: where this client trains and with what."""

    shard: int
    cut: str
    partition: int
    plan: RoundPlan
    strategy: Strategy

    def updated(self, config: Mapping[str, ConfigValue]) -> Membership:
        """This membership as an assignment's `config` changes it (shard, plan, algorithm)."""
        plan = self.plan.updated(config)
        shard = config_int(config, "shard")
        same = (plan.algorithm, plan.params) == (self.plan.algorithm, self.plan.params)
        return replace(
            self,
            shard=self.shard if shard is None else shard,
            plan=plan,
            strategy=self.strategy if same else build_strategy(plan.algorithm, plan.params),
        )


@dataclass
class RoundRunner:
    """Runs the rounds of one client; holds what lives across rounds."""

    link: ClientLink
    seat: Seat
    data: JobData
    seed: int
    # `evaluation.enabled`: a whole-model client reports its local accuracy after the round.
    evaluate: bool = True

    def run(
        self, model: SplitNet, member: Membership, assignment: WeightsAssignment
    ) -> WeightsUpdate:
        """Train one round from `assignment` on `model` (the update's tensors may be views of
        its weights: send it before the model goes back); raises `RoundAborted` when the
        round is lost."""
        link, stats = self.link, self.link.stats
        started, io_before = link.clock(), link.io_s
        up_before, down_before = stats.bytes_up, stats.bytes_down
        plan = member.plan
        load_partial(model, assignment.client_weights)
        load_partial(model, assignment.aux_weights)
        index = member.partition
        batches, steps = round_batches(
            client_batches(self.data, index, batch_size=plan.batch_size, seed=self.seed),
            local_epochs=plan.hyper.local_epochs,
            max_steps=plan.hyper.max_steps,
            round_index=assignment.round,
        )
        channel = BrokerChannel(
            link, assignment, shard=member.shard, cut=member.cut, wire_dtype=plan.wire_dtype
        )
        local = Tally()
        hook = None
        if not member.strategy.splits:
            # The whole model runs here: measure its training loss on the batches it sees.
            batches, hook = self._tallied(model, batches, local, plan.hyper.loss)
        # The algorithm's per-client tensors (`ClientContext.memory`) are cleared when the job
        # switches algorithm.
        algorithm, memory = self.seat.memory.take()
        if algorithm != plan.algorithm:
            memory = {}
        context = ClientContext(
            client=link.client,
            round=assignment.round,
            memory=memory,
            local_accuracy=lambda module: self._local_accuracy(index, module),
        )
        # A whole-model round waits on nothing: it computes within the host's gate.
        gate: AbstractContextManager[None] = (
            nullcontext() if member.strategy.splits else self.seat.compute.held()
        )
        try:
            with gate:
                result = member.strategy.client_round(
                    LocalRound(
                        model,
                        member.cut,
                        self._ticking(batches),
                        steps,
                        channel,
                        plan.hyper.at_round(assignment.round, steps),
                        context,
                    )
                )
        finally:
            if hook is not None:
                hook.remove()
            # What the algorithm remembered so far (a lost round may have changed it too, as
            # it would on a device).
            self.seat.memory.put(plan.algorithm, memory)
        metrics: dict[str, float] = {**channel.tally.metrics(), **local.metrics()}
        # An algorithm that measured its own model already (FedDeper's v_k, Sub-FedAvg's
        # pruned model) reports it in `result.metrics`, which wins below.
        measured = "personal_accuracy" in result.metrics
        if not member.strategy.splits and self.evaluate and not measured:
            metrics["personal_accuracy"] = self._local_accuracy(index, model)
        metrics.update(
            bytes_up=float(stats.bytes_up - up_before),
            bytes_down=float(stats.bytes_down - down_before),
            # The round's wall time, waits for gradients included, and the part of it spent
            # computing: a split client's own rate is not the rate the cohort trains at.
            round_wall_s=max(0.0, link.clock() - started),
            compute_s=max(0.0, (link.clock() - started) - (link.io_s - io_before)),
        )
        metrics.update(result.metrics)
        return WeightsUpdate(
            job=link.job,
            client=link.client,
            message_id=new_message_id(),
            version=assignment.version,
            round=assignment.round,
            samples=len(self.data.indices(index)),
            client_weights=result.client_weights,
            aux_weights=result.aux_weights,
            masks=result.masks,
            metrics=metrics,
        )

    def _ticking(self, batches: Iterator[Batch]) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Keeps the broker connection serviced between local steps, for algorithms that never
        wait on the broker (membership heartbeats have a thread of their own)."""
        for x, y in batches:
            self.link.keep_alive()
            yield x, y

    def _tallied(
        self, model: SplitNet, batches: Iterator[Batch], tally: Tally, loss_fn: LossFn
    ) -> tuple[Iterator[Batch], torch.utils.hooks.RemovableHandle]:
        labels: list[torch.Tensor] = []

        def on_forward(_module: nn.Module, _inputs: object, logits: torch.Tensor) -> None:
            if labels and logits.requires_grad:  # a training forward of the current batch
                y = labels.pop()
                with torch.no_grad():
                    loss = float(loss_fn(logits, y))
                    correct = int((logits.argmax(dim=1) == y).sum())
                tally.add(loss, correct, int(y.shape[0]))

        def remember() -> Iterator[Batch]:
            for batch in batches:
                labels[:] = [batch.y]
                yield batch

        return remember(), model.register_forward_hook(on_forward)

    def _local_accuracy(self, index: int, model: nn.Module) -> float:
        """`model` (inputs -> logits) on the client's local test set."""
        test = self.data.dataset.test
        picked = torch.from_numpy(self.data.local_test(index))
        if not len(picked):
            return 0.0
        correct = 0
        with self.seat.compute.held(), evaluating([model]):
            for chunk in picked.split(EVAL_CHUNK):
                logits = model(test.x.index_select(0, chunk))
                correct += int((logits.argmax(dim=1) == test.y.index_select(0, chunk)).sum())
        return correct / len(picked)
