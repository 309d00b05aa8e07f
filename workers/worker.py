"""A worker: holds shard leases, consumes those shards' queues, trains their replicas.

`Worker.run(stop)` blocks until `stop` (or, with `burst=True`, until its shard queues are empty
and checkpointed), then hands its shards over (docs/deployment.md, "Autoscaling workers": the
steps); after a crash the leases expire and another worker resumes from the checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from broker.errors import BrokerError, StaleDeliveryError
from broker.messages import RoundEnd, RoundStart, SmashedBatch, TailGradient
from broker.rejection import Rejected, Rejection, dead_letter_many_safely
from broker.store import WeightStore
from broker.topology import shard_queue_name
from broker.transport import Broker, Delivery
from services.algorithms.base import ServerSide
from services.algorithms.registry import build_strategy
from services.common.backends import Backends
from services.common.checks.addressing import wrong_type
from services.common.jobmodel import job_hyper, job_model
from services.common.leases import LeaseKeeper
from services.common.logs import in_log_context
from services.common.schedule import BatchKey, Entry, shard_history
from services.config.root import Settings
from services.security.identity import sender_check
from workers.clock import Continuous
from workers.device_io import Arrival, DevicePlane, Inbox, prefetches
from workers.gate import StepRule, Surplus
from workers.inference import InferenceServer
from workers.members import MemberCache
from workers.replica import Replica, open_replica, pick_device
from workers.replies import Replier
from workers.shard import LeaseLostError, ShardRunner
from workers.shard_checks import ShardExpectations
from workers.shard_io import ShardIO, ShardLimits
from workers.stats import WorkerStats

# The most deliveries a shard's consumer asks ahead for a canonical order (a round of local-loss
# clients): a bound on the memory they take.
_MAX_PREFETCH = 1024


class Worker:
    """One worker of a job; `run` it on the thread that will own its broker handle. `poll_s`
    bounds how long a `get` waits, i.e. how quickly `stop` is noticed."""

    def __init__(
        self,
        settings: Settings,
        backends: Backends,
        *,
        worker_id: str | None = None,
        poll_s: float = 0.2,
        script: Mapping[int, Sequence[Entry]] | None = None,
    ) -> None:
        """`script`: a replay's record, each shard's stream by shard: its shards serve their
        batches in the recorded order (`workers.sequencer.RecordedOrder`)."""
        self.settings = settings
        self.scripts: dict[int, tuple[BatchKey, ...]] = {
            shard: shard_history(entries).batches for shard, entries in (script or {}).items()
        }
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.strategy = build_strategy(settings.algorithm.name, settings.algorithm.params())
        self.poll_s = poll_s
        self.logger = logging.getLogger("splitmq.worker")
        self._backends = backends
        self.metrics = backends.metrics

    def run(self, stop: threading.Event, *, burst: bool = False) -> WorkerStats:
        stats = WorkerStats()
        if self.strategy.server is None:
            # FedAvg trains whole models on the clients: no server side, no shard to serve.
            # Idle rather than fail, so one compose file serves every algorithm.
            self.logger.warning(
                "worker %s: algorithm %s has no server-side model; idling until stopped",
                self.worker_id,
                self.strategy.name,
            )
            if not burst:
                stop.wait()
            return stats
        with contextlib.ExitStack() as handles:  # closed last-opened-first
            store = handles.enter_context(contextlib.closing(self._backends.open_store()))
            name = f"splitmq-worker-{self.worker_id}"
            broker = handles.enter_context(contextlib.closing(self._backends.open_broker(name)))
            if self.strategy.server.split_inference:
                # SplitGP: on a connection and thread of its own, ahead of training.
                server = InferenceServer(
                    self.settings,
                    self._backends,
                    worker_id=self.worker_id,
                    model_factory=lambda: job_model(self.settings),
                    logger=self.logger,
                )
                handles.callback(server.start())
            session: WorkerSession | None = None
            try:
                session = WorkerSession(self, broker, store, stop, stats)
                handles.callback(session.inbox.close)
                session.start()
                session.loop(burst)
                session.hand_over_all()
            except Exception:
                # Our own failure: give the shards away now rather than after the lease TTL;
                # the unacked deliveries go back with the connection and are applied on top of
                # the last checkpoints, exactly as after a crash.
                self.logger.exception("worker %s failed", self.worker_id)
                if session is not None:
                    session.release_all()
                raise
        self.logger.info("worker %s stopped: %s", self.worker_id, stats)
        return stats


@dataclass(eq=False)
class WorkerSession:
    """The state of one `Worker.run`: its broker handle, leases and shard runners. Each lease
    tick (a third of the TTL) it heartbeats, renews and rebalances; in between it dispatches
    deliveries to their shard's runner."""

    worker: Worker
    broker: Broker
    store: WeightStore
    stop: threading.Event
    stats: WorkerStats

    def __post_init__(self) -> None:
        worker, store = self.worker, self.store
        settings = self.settings = worker.settings
        self.worker_id = worker.worker_id
        self.strategy = worker.strategy
        server_side = self.strategy.server
        if server_side is None:  # Worker.run idles for these: no session is opened
            raise ValueError(f"{self.strategy.name} has no server side: no shard to serve")
        self.server_side = server_side
        self.job = settings.job.name
        self.log = worker.logger
        self.clock = time.monotonic
        self.metrics = worker.metrics
        ttl = settings.workers.lease_ttl_s
        self.keeper = LeaseKeeper(store, self.job, self.worker_id, settings.shards, ttl)
        self.tick_s = ttl / 3
        self.next_tick = 0.0
        # Deliveries a shard may hold unacked: a checkpoint interval, a whole cohort step
        # (MiniBatch-SFL buffers one batch per client) and a fold window, each twice over.
        w = settings.workers
        self.prefetch = max(
            2 * w.checkpoint_every_steps,
            2 * settings.clients.count,
            2 * w.batch_messages,
            16,
            self._round_ahead(settings, server_side, scripted=bool(worker.scripts)),
        )
        self.target = 1  # ceil(S / W) as of the last rebalance
        self.runners: dict[str, ShardRunner] = {}  # by queue name
        self.unloaded: set[int] = set()  # leased, but nothing published to load yet
        self.device = pick_device(settings.workers.device)
        self.plane = DevicePlane(self.device)
        ahead = prefetches(settings.workers.prefetch, self.device)
        self.inbox = Inbox(self.broker, self.plane, ahead=ahead)
        self.template = job_model(settings)
        self.hyper = job_hyper(settings)
        # The first optimizer of a process imports torch._dynamo: seconds, more than a short
        # lease TTL on a busy machine. Pay for it before holding any lease.
        self.hyper.server_optimizer(self.template.parameters())
        self.poll_s = worker.poll_s
        # Checkpoint before this many unacked deliveries: prefetch is finite.
        margin = max(settings.workers.batch_messages, settings.clients.count)
        self.pending_limit = max(1, self.prefetch - margin)
        # The last reply per client, for a copy of a batch whose reply was lost: room for
        # every member (clients beyond `count` are refused) and for some that left.
        self.replier = Replier(self.broker, self.stop, self.log, keep=2 * settings.clients.count)
        # Whether the job's coordinator admitted a client.
        self.members = MemberCache(store, self.job, self.clock)
        # Refusals dead-lettered together: a flood's cost is mostly the wait for the broker's
        # confirms, once per batch; half the prefetch leaves the other half to serve.
        self.surplus = Surplus(size=max(1, self.prefetch // 2), clock=self.clock)
        self.senders = sender_check(settings)
        self.busy = BusyMeter(self.clock)
        self.shard_io = self._shard_io()

    @staticmethod
    def _round_ahead(settings: Settings, server_side: ServerSide, *, scripted: bool) -> int:
        """A deterministic sync job whose clients do not wait for the gradient (local loss) may
        send a whole round before the turn of the others comes: the worker holds them all in
        canonical order (`workers.sequencer`), so its prefetch covers a round of every client,
        where the round's steps are bounded (else the sequencer's limit stops waiting). So does a
        replay's (`scripted`: the recorded order holds batches as the canonical one does)."""
        a = settings.algorithm
        if not (settings.job.deterministic or scripted) or settings.asynchronous_mode:
            return 0
        if server_side.waits_for_gradient or server_side.barrier:
            return 0
        steps = a.max_steps_per_round
        return min(_MAX_PREFETCH, settings.clients.count * steps + settings.clients.count)

    def _shard_io(self) -> ShardIO:
        """What this session's runners may reach: nothing else of it."""
        w, a = self.settings.workers, self.settings.algorithm
        limits = ShardLimits(
            batch_messages=w.batch_messages,
            step_timeout_s=w.step_barrier_timeout_s,
            checkpoint_every_steps=w.checkpoint_every_steps,
            checkpoint_every_s=w.checkpoint_every_s,
            pending_limit=self.pending_limit,
            rule=StepRule(a.batch_size, a.local_epochs, a.max_steps_per_round),
            deterministic=self.settings.job.deterministic,
        )
        return ShardIO(
            worker_id=self.worker_id,
            server_side=self.server_side,
            loss=self.hyper.loss,
            limits=limits,
            store=self.store,
            replier=self.replier,
            plane=self.plane,
            members=self.members,
            senders=self.senders,
            stats=self.stats,
            metrics=self.metrics,
            clock=self.clock,
            log=self.log,
            ack=self.broker.ack,
            refuse=self.refuse,
            renew=self.keeper.renew,
            redeliver=self.redeliver,
            scripts=self.worker.scripts,
        )

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.broker.declare(self.settings.job_queues())
        self._say(
            "joins (%d shards, device %s, prefetch %d)",
            self.settings.shards,
            self.device,
            self.prefetch,
        )
        self.rebalance()

    def loop(self, burst: bool) -> None:
        while not self.stop.is_set():
            now = self.clock()
            if now >= self.next_tick:
                self.rebalance()
            waiting_since = self.clock()
            arrival = self.inbox.get(self._timeout(now))
            self.busy.waited(self.clock() - waiting_since)
            if arrival is not None:
                self.dispatch(arrival)
            if self.surplus.letters and self.surplus.due():
                self.settle_surplus()
            # Each runner's time-driven work; with nothing more queued, its folded batches too.
            idle = arrival is None
            for runner in list(self.runners.values()):
                try:
                    runner.poll(idle=idle)
                except LeaseLostError:
                    self.drop(runner.shard)
            if burst and arrival is None and self._drained():
                return

    def hand_over_all(self) -> None:
        for runner in list(self.runners.values()):
            self.hand_over(runner)
        for shard in list(self.unloaded):
            self.keeper.release(shard)
        self.unloaded.clear()
        self.keeper.leave()

    def release_all(self) -> None:
        """After a failure: leases go without a checkpoint (the deliveries return unacked)."""
        try:
            for shard in {r.shard for r in self.runners.values()} | self.unloaded:
                self.keeper.release(shard)
            self.keeper.leave()
        except Exception:
            self._say("could not release its leases", level=logging.ERROR, exc_info=True)

    # --- leases -------------------------------------------------------------------------------
    def rebalance(self) -> None:
        self.next_tick = self.clock() + self.tick_s
        held = {r.shard for r in self.runners.values()} | self.unloaded
        # Who and how busy we are, for `splitmq check worker`, the autoscaler and (samples, the
        # metrics URL) the dashboard's workers table.
        info = {**self.metrics.member_info(), "host": socket.gethostname(), "pid": str(os.getpid())}
        busy = self.busy.take(min_window_s=self.tick_s / 2)
        if busy is not None:
            info["busy"] = f"{busy:.3f}"
        plan = self.keeper.plan(held, info)
        self.target = plan.target
        for shard in plan.lost:
            self.drop(shard)
        for shard in plan.release:
            runner = self.runners.get(shard_queue_name(self.job, shard))
            if runner is not None:
                self.hand_over(runner)
            else:
                self.unloaded.discard(shard)
                self.keeper.release(shard)
        for shard in [*plan.acquired, *self.unloaded]:
            self.load(shard)
        self._report(plan.workers)

    def _report(self, workers: int) -> None:
        """Gauges worth a broker call only once a tick: depth of the held shards' queues."""
        if not self.metrics.enabled:
            return
        self.metrics.members("worker", workers)
        for queue, runner in self.runners.items():
            self.metrics.version(runner.replica.version)
            try:
                depth = self.broker.queue_depth(queue)
            except BrokerError as exc:  # a gauge is not worth a worker
                self.log.debug("worker %s: no depth of %s: %r", self.worker_id, queue, exc)
                continue
            self.metrics.queue_depth(runner.shard, depth)

    def load(self, shard: int) -> None:
        # Batches may come from several cuts (FedSplitX's levels): the replica starts at the
        # shallowest, so it holds every layer any of them needs.
        cuts = self.server_side.batch_cuts(self.template, self.settings.model.cut)
        make = partial(
            Replica, shard, self.template, cuts[0], self.hyper.server_optimizer, self.device
        )
        replica = open_replica(self.store, self.job, make, self.log)
        if replica is None:
            self.unloaded.add(shard)
            return
        self.unloaded.discard(shard)
        if not self.keeper.renew(shard):
            # Loading outlasted the lease and another worker has the shard now.
            self.stats.shards_lost += 1
            self._say("lease of shard %d expired while loading", shard, level=logging.WARNING)
            return
        want = ShardExpectations(
            job=self.job,
            shard=shard,
            cut_shape=self.template.cut_shape(cuts[0]),
            num_classes=self.settings.model.num_classes,
            cut=cuts[0],
            other_cuts={c: self.template.cut_shape(c) for c in cuts[1:]},
            u_shaped=self.template.tail is not None,
        )
        queue = shard_queue_name(self.job, shard)
        clock = None
        if self.settings.asynchronous_mode:  # docs/async.md: the bound on smashed data's staleness
            bound = self.settings.asynchronous.worker_max_staleness
            clock = Continuous(replica, self.store, self.job, bound, self.stats, self.log)
        self.runners[queue] = ShardRunner(replica, want, clock, self.shard_io)
        self.broker.subscribe(queue, prefetch=self.prefetch)
        self.stats.shards_acquired += 1
        args = (shard, replica.version, replica.applied, replica.round + 1)
        self._say("holds shard %d (version %d, %d applied, round %d)", *args)

    def hand_over(self, runner: ShardRunner) -> None:
        self.settle_surplus()
        queue = shard_queue_name(self.job, runner.shard)
        try:
            runner.checkpoint()
        except LeaseLostError:
            self.drop(runner.shard)
            return
        self.broker.unsubscribe(queue)
        self.inbox.forget(queue)
        del self.runners[queue]
        self.keeper.release(runner.shard)
        self.stats.shards_released += 1
        self._say("handed over shard %d", runner.shard)

    def redeliver(self, shard: int) -> None:
        self.settle_surplus()
        queue = shard_queue_name(self.job, shard)
        self.broker.unsubscribe(queue)
        self.inbox.forget(queue)
        self.broker.subscribe(queue, prefetch=self.prefetch)

    def drop(self, shard: int) -> None:
        """The lease is someone else's: forget the replica, give every delivery back."""
        queue = shard_queue_name(self.job, shard)
        self.unloaded.discard(shard)
        if self.runners.pop(queue, None) is None:
            return
        self.settle_surplus()
        self.broker.unsubscribe(queue)
        self.inbox.forget(queue)
        self.stats.shards_lost += 1
        self._say("lost the lease of shard %d", shard, level=logging.WARNING)

    # --- deliveries ---------------------------------------------------------------------------
    def dispatch(self, arrival: Arrival) -> None:
        delivery, message = arrival.delivery, arrival.message
        runner = self.runners.get(delivery.queue)
        if runner is None:  # not ours (any more): let the holder have it
            with contextlib.suppress(StaleDeliveryError):  # then it is back in the queue already
                self.broker.nack(delivery, requeue=True)
            return
        if message is None:  # its body was refused
            assert arrival.error is not None
            self.refuse(delivery, Rejection("decode", arrival.error.reason).reason)
            return
        if not isinstance(message, SmashedBatch | TailGradient | RoundStart | RoundEnd):
            self.refuse(delivery, wrong_type(message, "a shard queue").reason)
            return
        # The message's type picks the handler, which runs the runner's chain of checks for
        # that type first.
        context = {"shard": runner.shard, "client": message.client or None}
        try:
            if isinstance(message, SmashedBatch):
                in_log_context(context, runner.on_batch, delivery, message)
            elif isinstance(message, TailGradient):
                in_log_context(context, runner.on_tail, delivery, message)
            else:
                in_log_context(context, runner.on_marker, delivery, message)
        except LeaseLostError:
            self.drop(runner.shard)

    def _say(
        self, message: str, *args: object, level: int = logging.INFO, exc_info: bool = False
    ) -> None:
        prefix = "worker %s job %s: "
        self.log.log(level, prefix + message, self.worker_id, self.job, *args, exc_info=exc_info)

    def refuse(self, delivery: Delivery, reason: str) -> None:
        """Dead-letter `delivery` with `reason` (`"<code>: <detail>"`) in the next batch of
        refusals: a flood costs one wait for the broker per batch, not per message (issue 33:
        a flood must drain faster than one client can publish it)."""
        self.surplus.add(delivery, reason)

    def settle_surplus(self) -> None:
        """Dead-letter the refusals waiting: before anything that gives deliveries back to the
        queue (they would come back to be judged again), and whenever they are due."""
        letters = self.surplus.take()
        if not letters:
            return
        outcomes = dead_letter_many_safely(self.broker, letters)
        for (delivery, reason), outcome in zip(letters, outcomes, strict=True):
            if outcome is Rejected.REDELIVERED:  # judged again when it comes back
                continue
            code = reason.split(":", 1)[0]
            self.stats.dead_lettered[code] += 1
            if count := self.surplus.settled(code):
                args = (count, delivery.queue, reason)
                self._say(
                    "dead-lettered %d message(s) from %s, the last: %s",
                    *args,
                    level=logging.WARNING,
                )

    def _timeout(self, now: float) -> float:
        # A runner with folded batches wakes at -inf: fold only what is already waiting (look,
        # don't wait).
        until = [self.next_tick, now + self.poll_s]
        if self.surplus.letters:
            until.append(now + self.surplus.time_left())
        for runner in self.runners.values():
            if (at := runner.wake_at()) is not None:
                until.append(at)
        return max(0.0, min(until) - now)

    def _drained(self) -> bool:
        """Burst mode: our share of shards held and loaded, nothing buffered, nothing queued
        (a burst worker that can never get its share, W > S, runs until `stop`)."""
        if self.unloaded or len(self.runners) < self.target:
            return False
        if any(r.buffered() for r in self.runners.values()):
            return False
        return all(self.broker.queue_depth(q) == 0 for q in self.runners)


class BusyMeter:
    """How busy a worker is: the share of wall time it spent on anything but waiting for a
    delivery, which the autoscaler reads from its heartbeat (docs/deployment.md, "Autoscaling
    workers": why queue depth alone cannot tell). Accumulates waiting time; `take` turns a
    window of it into a busy fraction.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._since = clock()
        self._waited = 0.0
        self._last: float | None = None

    def waited(self, seconds: float) -> None:
        """A wait that ended now; only its part inside the window counts (a poll that began
        before the last `take` would otherwise push an idle window's waiting past its length)."""
        self._waited += min(max(0.0, seconds), max(0.0, self._clock() - self._since))

    def take(self, min_window_s: float = 0.0) -> float | None:
        """The busy fraction since the previous `take`, then a new window starts. A window
        shorter than `min_window_s` says too little (a worker just started is "busy" loading
        its replicas): the previous fraction instead (None until there is one), the window
        goes on."""
        now = self._clock()
        elapsed = now - self._since
        if elapsed <= 0 or elapsed < min_window_s:
            return self._last
        fraction = min(1.0, max(0.0, 1.0 - self._waited / elapsed))
        self._since, self._waited, self._last = now, 0.0, fraction
        return fraction
