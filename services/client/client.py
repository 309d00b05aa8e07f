"""An edge client (architecture steps 2, 4, 7): join, train, leave.

Sync and async jobs (docs/async.md, "The protocol") run one loop; the Welcome picks its clock
(services/client/clocks.py). `Client` joins, hands each round to a `RoundRunner`
(services/client/runner.py) and says a dropped round with a `RoundDropped`
(services/client/drops.py; docs/reliability.md, "Liveness").
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import KW_ONLY, InitVar, dataclass, replace
from functools import partial

from broker.errors import EncodeError
from broker.messages import (
    Error,
    GradientReply,
    Join,
    Message,
    WeightsAssignment,
    Welcome,
    new_message_id,
)
from broker.topology import updates_routing_key
from broker.transport import QueueSpec
from services.client.beat import HeartbeatThread
from services.client.clocks import Clock, Idle, Newest, Rounds
from services.client.data import JobData
from services.client.drops import drop_notice, drop_reason
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
from services.client.link import ClientLink
from services.client.membership import Membership
from services.client.plan import RoundPlan, config_int
from services.client.runner import RoundRunner
from services.client.secured import secured_client_broker
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from services.data.loaders import Dataset
from services.security.hidden import client_reply_queue, queue_secret
from services.security.identity import CLIENT_ID


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
        member = Membership.settled(welcome.shard, welcome.cut, index, plan)
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
