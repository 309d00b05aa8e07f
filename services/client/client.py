"""An edge client (architecture steps 2, 4, 7): join, train each assigned round, leave.

The client talks only to the broker (design §3): weights arrive in Welcome and
WeightsAssignment, updates leave as WeightsUpdate. It owns one broker handle, opened in `run`
on the calling thread.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable

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
from broker.topology import CONTROL_EXCHANGE, updates_routing_key
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.registry import build_strategy
from services.client.async_loop import AsyncLoop, is_async
from services.client.channel import SeqBook
from services.client.data import JobData
from services.client.drops import drop_notice
from services.client.errors import (
    ClientError,
    ClientSettingsError,
    ClientStopped,
    JoinRejectedError,
    JoinTimeoutError,
    RoundAborted,
    Superseded,
)
from services.client.link import Backoff, ClientLink
from services.client.plan import RoundPlan, config_int
from services.client.round import Membership, RoundRunner, weights_problem
from services.client.secured import secured_client_broker
from services.client.stats import ClientStats
from services.common.backends import Backends
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from services.data.loaders import Dataset

_CLIENT_ID = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # it becomes part of queue names and keys
IDLE_POLL_S = 1.0


def build_client_model(settings: Settings) -> SplitNet:
    """The job's model shaped for its dataset (weights come from the service, not the seed)."""
    return job_model(settings)


class Client:
    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        client_id: str,
        partition: int | None = None,
        dataset: Dataset | JobData | None = None,
        join_retry_s: float = 5.0,
        join_give_up_s: float = 120.0,
        route_wait_s: float = 60.0,
        max_republish: int = 5,
        backoff: Backoff | None = None,
        seq_start: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        if not _CLIENT_ID.match(client_id):
            raise ClientSettingsError(
                f"client id {client_id!r}: use 1-64 letters, digits, '_' or '-' (--id)"
            )
        if partition is not None and not 0 <= partition < settings.clients.count:
            raise ClientSettingsError(
                f"partition {partition} outside 0..{settings.clients.count - 1}: the job has "
                f"{settings.clients.count} clients (--partition, clients.count)"
            )
        self._settings = settings
        self._backends = backends
        self.client_id = client_id
        self._partition = partition
        self._data = dataset if isinstance(dataset, JobData) else JobData(settings, dataset)
        self._join_retry_s = join_retry_s
        self._join_give_up_s = join_give_up_s
        self._route_wait_s = route_wait_s
        self._max_republish = max_republish
        self._backoff = backoff or Backoff()
        # Seqs must keep rising across restarts of a client (workers skip seq <= last applied),
        # so by default they start at the wall clock in microseconds.
        self._seq_start = seq_start if seq_start is not None else time.time_ns() // 1000
        self._clock = clock
        self._rng = rng or random.Random()
        self._log = logger or logging.getLogger("splitmq.client")
        self._job = settings.job.name
        self._welcome: Welcome | None = None  # the last Welcome: async mode's first weights
        self._session = new_message_id()  # renewed by each run()

    def run(self, stop: threading.Event) -> ClientStats:
        """Join, train every assigned round, leave; returns when the job finishes or on stop.

        Raises `ClientError` when the client cannot take part at all (no Welcome in time, no
        data partition, the service side missing).
        """
        stats = ClientStats()
        # Every Join of this run names it: a run after a leave, or a restart after a crash,
        # is another process to the aggregator (it drops the old one from an open round).
        self._session = new_message_id()
        broker = secured_client_broker(
            self._settings, self._backends, self.client_id, f"splitmq-client-{self.client_id}"
        )
        link = ClientLink(
            broker,
            job=self._job,
            client=self.client_id,
            stats=stats,
            stop=stop,
            clock=self._clock,
            heartbeat_s=self._settings.clients.heartbeat_s,
            backoff=self._backoff,
            rng=self._rng,
            route_wait_s=self._route_wait_s,
            logger=self._log,
            # Heartbeats from a thread and connection of their own (services/client/beat.py).
            open_beat_broker=lambda: secured_client_broker(
                self._settings,
                self._backends,
                self.client_id,
                f"splitmq-client-{self.client_id}-heartbeat",
            ),
        )
        reason = "finished"
        try:
            link.open()
            model = build_client_model(self._settings)
            # The first optimizer of a process imports torch._dynamo: seconds of CPU. Pay for
            # it before joining, not inside the first round, where it would make a newly
            # joined client miss a tight round deadline.
            job_hyper(self._settings).client_optimizer(model.parameters())
            link.validate_with(lambda m: self._problem(m, model))
            member = self._join(link, model, stats)
            welcome = self._welcome
            if member is not None and welcome is not None and is_async(welcome.config):
                self._serve_async(link, model, member, welcome, stats)
            elif member is not None:
                self._serve(link, model, member, stats)
        except ClientStopped:
            reason = "stopped"
        except BaseException as exc:
            reason = f"failed: {exc}"[:200]
            raise
        finally:
            link.leave(reason)
            broker.close()
        # The batch count is what compose/smoke.sh checks against the shards' applied counts;
        # benchmarks/backpressure_memory.py sums the refusals.
        self._log.info(
            "job %s client %s: %s after %d rounds, %d batches sent, %d back-pressure refusals",
            self._job,
            self.client_id,
            reason,
            stats.rounds,
            stats.batches_sent,
            stats.backpressure_retries,
        )
        return stats

    # --- join -------------------------------------------------------------------------------------

    def _join(self, link: ClientLink, model: SplitNet, stats: ClientStats) -> Membership | None:
        """Join until welcomed; None when the job turns out to be over already."""
        join_ids = {self._send_join(link, self._partition, stats)}
        give_up_at = self._clock() + self._join_give_up_s
        resend_at = self._clock() + self._join_retry_s
        while True:
            now = self._clock()
            if now >= give_up_at:
                raise JoinTimeoutError(
                    f"job {self._job} client {self.client_id}: no Welcome after "
                    f"{self._join_give_up_s:.0f} s ({len(join_ids)} Joins sent); is the "
                    "coordinator running?"
                )
            if now >= resend_at:
                join_ids.add(self._send_join(link, self._partition, stats))
                resend_at = now + self._join_retry_s
            message = link.poll(min(resend_at, give_up_at) - now)
            if isinstance(message, Welcome):
                return self._welcomed(link, model, message, stats)
            if isinstance(message, WeightsAssignment):
                if message.config.get("finished") is True:
                    self._ended(stats.dismissed(message.config))
                    return None
                link.defer(message)  # raced ahead of the Welcome
            elif isinstance(message, Error) and message.ref_message_id in join_ids:
                raise JoinRejectedError(
                    f"job {self._job} client {self.client_id}: Join refused: "
                    f"{message.code}: {message.reason}"
                )
            elif message is not None:
                self._note(message, stats)

    def _ended(self, status: str) -> None:
        if status != "finished":  # e.g. "failed: ..." when no round could make progress
            self._log.warning(
                "job %s client %s: the job ended: %s", self._job, self.client_id, status
            )

    def _send_join(self, link: ClientLink, index: int | None, stats: ClientStats) -> str:
        info = {"session": self._session}
        samples = 0
        if index is not None:
            samples = len(self._data.indices(index))
            info["index"] = str(index)
            info["classes"] = ",".join(str(c) for c in self._data.classes(index))
        capability = self._settings.clients.declared_capability(index)
        join = Join(
            self._job, self.client_id, new_message_id(), link.version, samples, capability, info
        )
        link.send(CONTROL_EXCHANGE, self._job, join)
        stats.joins_sent += 1
        return join.message_id

    def _welcomed(
        self, link: ClientLink, model: SplitNet, welcome: Welcome, stats: ClientStats
    ) -> Membership:
        # The coordinator's assignment wins over the index asked for: shard choice and
        # evaluation go by its record, and it may have moved a client off a taken index.
        index = config_int(welcome.config, "partition")
        if index is None:
            index = self._partition
        if index is None or index >= self._settings.clients.count:
            raise ClientError(
                f"job {self._job} client {self.client_id}: no usable data partition (Welcome "
                f"says {welcome.config.get('partition')!r}): pass one, or have the coordinator "
                "assign it"
            )
        if index != self._partition:
            if self._partition is not None:
                self._log.warning(
                    "job %s client %s: asked for partition %d, the coordinator assigned %d",
                    self._job,
                    self.client_id,
                    self._partition,
                    index,
                )
            # The coordinator records samples and classes from a Join: send the right ones.
            self._send_join(link, index, stats)
        plan = RoundPlan.from_settings(self._settings).updated(welcome.config)
        self._welcome = welcome
        load_partial(model, welcome.client_weights)
        load_partial(model, welcome.aux_weights)
        link.version = welcome.version
        link.start_heartbeats()
        self._log.info(
            "job %s client %s: welcomed at version %d: shard %d, cut %s, partition %d",
            self._job,
            self.client_id,
            welcome.version,
            welcome.shard,
            welcome.cut,
            index,
        )
        return Membership(
            welcome.shard, welcome.cut, index, plan, build_strategy(plan.algorithm, plan.params)
        )

    # --- rounds -----------------------------------------------------------------------------------

    def _serve_async(
        self,
        link: ClientLink,
        model: SplitNet,
        member: Membership,
        welcome: Welcome,
        stats: ClientStats,
    ) -> None:
        """Async mode (docs/async.md): local rounds back to back, no assignments awaited."""
        runner = self._runner(link, model, stats)
        AsyncLoop(
            link=link,
            runner=runner,
            member=member,
            stats=stats,
            samples=len(self._data.indices(member.partition)),
            rejoin=lambda: self._send_join(link, member.partition, stats),
            note=lambda message: self._note(message, stats, runner.seqs),
            answer_timeout_s=self._settings.clients.reply_timeout_s,
            clock=self._clock,
            logger=self._log,
        ).run(welcome)

    def _runner(self, link: ClientLink, model: SplitNet, stats: ClientStats) -> RoundRunner:
        return RoundRunner(
            job=self._job,
            client=self.client_id,
            seed=self._settings.job.seed,
            model=model,
            data=self._data,
            link=link,
            seqs=SeqBook(self._seq_start),
            stats=stats,
            reply_timeout_s=self._settings.clients.reply_timeout_s,
            max_republish=self._max_republish,
            clock=self._clock,
            logger=self._log,
        )

    def _serve(
        self, link: ClientLink, model: SplitNet, member: Membership, stats: ClientStats
    ) -> None:
        runner = self._runner(link, model, stats)
        last_round = -1
        # The assignment whose round this client dropped last (None: it uploaded that round).
        # The aggregator reopens a round that got no valid update with a new assignment for the
        # same round: a dropped round is tried again then, an uploaded one never.
        dropped: str | None = None
        while True:
            message = link.poll(IDLE_POLL_S, deferred=True)
            if isinstance(message, Error) and message.code == "unknown_member":
                # Our membership expired (e.g. a heartbeat gap longer than the TTL): join again
                # rather than stall; the coordinator's next assignment names our shard.
                self._log.warning(
                    "job %s client %s: membership expired, joining again", self._job, self.client_id
                )
                self._send_join(link, member.partition, stats)
            if not isinstance(message, WeightsAssignment):
                if message is not None:
                    self._note(message, stats, runner.seqs)
                continue
            if message.config.get("finished") is True:
                self._ended(stats.dismissed(message.config))
                return
            if not message.participate or message.round < last_round:
                continue
            retry = dropped is not None and message.message_id != dropped
            if message.round == last_round and not retry:
                continue  # a copy of an assignment already handled, or an uploaded round
            last_round = message.round
            uploaded = self._round(link, runner, member, message, stats)
            dropped = None if uploaded else message.message_id

    def _round(
        self,
        link: ClientLink,
        runner: RoundRunner,
        member: Membership,
        assignment: WeightsAssignment,
        stats: ClientStats,
    ) -> bool:
        """Train the assigned round and upload it; False when it was dropped (and said so)."""
        link.version = assignment.version
        shard = config_int(assignment.config, "shard")
        plan = member.plan.updated(assignment.config)
        member = Membership(
            shard=member.shard if shard is None else shard,
            cut=member.cut,
            partition=member.partition,
            plan=plan,
            strategy=(
                member.strategy
                if (plan.algorithm, plan.params) == (member.plan.algorithm, member.plan.params)
                else build_strategy(plan.algorithm, plan.params)
            ),
        )
        try:
            update = runner.run(member, assignment)
            link.send(CONTROL_EXCHANGE, updates_routing_key(self._job), update)
        except (EncodeError, RoundAborted) as exc:  # EncodeError: the local model diverged
            self._dropped(link, stats, assignment, exc)
            return False
        stats.rounds += 1
        self._log.info(
            "job %s client %s: round %d done at version %d: %s",
            self._job,
            self.client_id,
            assignment.round,
            assignment.version,
            {k: round(v, 4) for k, v in update.metrics.items()},
        )
        return True

    def _dropped(
        self, link: ClientLink, stats: ClientStats, assignment: WeightsAssignment, exc: Exception
    ) -> None:
        stats.rounds_aborted += 1
        notice = drop_notice(self._job, self.client_id, assignment, exc)
        self._log.warning(
            "job %s client %s: round %d dropped (%s): %s",
            self._job,
            self.client_id,
            assignment.round,
            notice.reason,
            exc,
        )
        if not isinstance(exc, Superseded):
            # Said at once, so the round need not wait for its deadline to learn it.
            link.send(CONTROL_EXCHANGE, updates_routing_key(self._job), notice)

    # --- checks and notes -------------------------------------------------------------------------

    def _problem(self, message: Message, model: SplitNet) -> str | None:
        """Why a Welcome or assignment cannot be used by this client, or None."""
        if not isinstance(message, Welcome | WeightsAssignment):
            return None
        kind = type(message).__name__
        if isinstance(message, WeightsAssignment) and not message.participate:
            return None
        try:
            RoundPlan.from_settings(self._settings).updated(message.config)
            config_int(message.config, "partition")
            config_int(message.config, "shard")
            if isinstance(message, Welcome):
                model.cut_index(message.cut)
        except ValueError as exc:  # ModelSpecError included
            return f"{kind}: {exc}"
        for weights in (message.client_weights, message.aux_weights):
            problem = weights_problem(model, weights)
            if problem is not None:
                return f"{kind}: {problem}"
        return None

    def _note(self, message: Message, stats: ClientStats, seqs: SeqBook | None = None) -> None:
        """Replies outside any exchange: late errors and duplicates."""
        if isinstance(message, Error):
            stats.errors_received += 1
            self._log.warning(
                "job %s client %s: error reply %s: %s",
                self._job,
                self.client_id,
                message.code,
                message.reason,
            )
        elif isinstance(message, GradientReply):
            if seqs is not None and message.seq in seqs.unawaited:
                # A late answer to a batch sent without waiting (local-loss algorithms).
                seqs.unawaited.discard(message.seq)
                stats.replies_received += 1
            else:
                stats.duplicates_dropped += 1
        else:
            self._log.debug(
                "job %s client %s: ignoring %s", self._job, self.client_id, type(message).__name__
            )
