"""One run of a worker: its broker handle, its leases, the runners of the shards it holds.

Each lease tick (a third of the lease TTL) it heartbeats, renews its leases and rebalances
(`services.common.leases`); in between it pulls deliveries from the shard queues it subscribed
to and hands each to the runner of its shard (`workers.shard`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from broker.codec import decode
from broker.errors import BrokerError, DecodeError, StaleDeliveryError
from broker.messages import RoundEnd, RoundStart, SmashedBatch
from broker.store import WeightStore
from broker.topology import QueueLimits, job_queues, shard_queue_name
from broker.transport import Broker, Delivery
from services.algorithms.base import Strategy, batch_cuts
from services.common.leases import LeaseKeeper, lease_name
from services.common.logs import log_context
from services.config.root import Settings
from services.metrics.recorder import NO_METRICS, Metrics
from services.security.identity import sender_check
from workers.busy import BusyMeter
from workers.checks import ShardExpectations
from workers.deadletter import reject
from workers.members import MemberCache
from workers.model import ModelFactory, job_hyper, pick_device
from workers.replica import Replica, open_replica
from workers.replies import Replier
from workers.shard import LeaseLostError, ShardPolicy, ShardRunner, ShardServices
from workers.stats import WorkerStats


def prefetch_for(settings: Settings) -> int:
    """Deliveries a shard may hold unacked: room for a checkpoint interval twice over, a whole
    cohort step twice over (MiniBatch-SFL buffers one batch per client), and a fold window."""
    w = settings.workers
    return max(2 * w.checkpoint_every_steps, 2 * settings.clients.count, 2 * w.batch_messages, 16)


@dataclass(frozen=True)
class WorkerSpec:
    """Who the worker is and what it runs; fixed for the worker's lifetime."""

    settings: Settings
    worker_id: str
    strategy: Strategy
    model_factory: ModelFactory
    clock: Callable[[], float]
    poll_s: float
    logger: logging.Logger
    metrics: Metrics = NO_METRICS


class WorkerSession:
    """The state of one `Worker.run`: its broker handle, leases and shard runners."""

    def __init__(
        self,
        spec: WorkerSpec,
        broker: Broker,
        store: WeightStore,
        stop: threading.Event,
        stats: WorkerStats,
    ) -> None:
        settings = spec.settings
        self.worker_id = spec.worker_id
        self.settings = settings
        self.job = settings.job.name
        self.shards = settings.shards
        self.broker = broker
        self.store = store
        self.stop = stop
        self.stats = stats
        self.log = spec.logger
        self.clock = spec.clock
        self.metrics = spec.metrics
        self.keeper = LeaseKeeper(
            self.store, self.job, spec.worker_id, self.shards, settings.workers.lease_ttl_s
        )
        self.tick_s = settings.workers.lease_ttl_s / 3
        self.next_tick = 0.0
        self.prefetch = prefetch_for(settings)
        self.target = 1  # ceil(S / W) as of the last rebalance
        self.runners: dict[str, ShardRunner] = {}  # by queue name
        self.unloaded: set[int] = set()  # leased, but nothing published to load yet
        self.device = pick_device(settings.workers.device)
        self.template = spec.model_factory()
        self.hyper = job_hyper(settings)
        # The first optimizer of a process imports torch._dynamo: seconds, more than a short
        # lease TTL on a busy machine. Pay for it before holding any lease.
        self.hyper.server_optimizer(self.template.parameters())
        self.barrier = spec.strategy.server_barrier
        self.poll_s = spec.poll_s
        margin = max(settings.workers.batch_messages, settings.clients.count)
        self.policy = ShardPolicy(
            batch_messages=settings.workers.batch_messages,
            checkpoint_every_steps=settings.workers.checkpoint_every_steps,
            checkpoint_every_s=settings.workers.checkpoint_every_s,
            pending_limit=max(1, self.prefetch - margin),
            barrier_timeout_s=settings.workers.step_barrier_timeout_s,
            async_max_staleness=(
                settings.asynchronous.worker_max_staleness if settings.asynchronous_mode else None
            ),
        )
        self.services = ShardServices(
            broker=broker,
            store=self.store,
            strategy=spec.strategy,
            # The last reply per client, for a copy of a batch whose reply was lost: room for
            # every member (clients beyond `count` are refused) and for some that left.
            replier=Replier(broker, stop, self.log, keep=2 * settings.clients.count),
            stats=stats,
            renew_lease=self.keeper.renew,
            redeliver=self.redeliver,
            clock=self.clock,
            logger=self.log,
            metrics=spec.metrics,
            known_client=MemberCache(self.store, self.job, self.clock),
            lease_holder=lambda shard: (lease_name(shard), self.worker_id),
        )
        self.senders = sender_check(settings)
        self.busy = BusyMeter(self.clock)

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        limits = QueueLimits(
            self.settings.broker.shard_queue_max_length, self.settings.broker.shard_queue_max_bytes
        )
        self.broker.declare(job_queues(self.job, self.shards, limits))
        self.log.info(
            "worker %s joins job %s (%d shards, device %s, prefetch %d)",
            self.worker_id,
            self.job,
            self.shards,
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
            delivery = self.broker.get(self._timeout(now))
            self.busy.waited(self.clock() - waiting_since)
            if delivery is None:
                self._each(ShardRunner.flush)
            else:
                self.dispatch(delivery)
            self._each(ShardRunner.poll)
            if burst and delivery is None and self._drained():
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
            for runner in self.runners.values():
                self.keeper.release(runner.shard)
            for shard in self.unloaded:
                self.keeper.release(shard)
            self.keeper.leave()
        except Exception:
            self.log.exception("worker %s: could not release its leases", self.worker_id)

    # --- leases -------------------------------------------------------------------------------
    def rebalance(self) -> None:
        self.next_tick = self.clock() + self.tick_s
        held = {r.shard for r in self.runners.values()} | self.unloaded
        plan = self.keeper.plan(held, self._heartbeat_info())
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

    def _heartbeat_info(self) -> dict[str, str]:
        """Who and how busy we are, for `splitmq check worker` and the autoscaler."""
        # samples and the metrics URL, for the dashboard's workers table
        info = {**self.metrics.member_info(), "host": socket.gethostname(), "pid": str(os.getpid())}
        busy = self.busy.take(min_window_s=self.tick_s / 2)
        if busy is not None:
            info["busy"] = f"{busy:.3f}"
        return info

    def load(self, shard: int) -> None:
        # Batches may come from several cuts (FedSplitX's levels): the replica starts at the
        # shallowest, so it holds every layer any of them needs.
        cuts = batch_cuts(self.services.strategy, self.template, self.settings.model.cut)

        def make() -> Replica:
            return Replica(
                shard,
                self.template,
                cuts[0],
                self.hyper.server_optimizer,
                self.device,
            )

        replica = open_replica(self.store, self.job, make, self.log)
        if replica is None:
            self.unloaded.add(shard)
            return
        self.unloaded.discard(shard)
        if not self.keeper.renew(shard):
            # Loading outlasted the lease and another worker has the shard now.
            self.stats.shards_lost += 1
            self.log.warning(
                "worker %s: lease of shard %d expired while loading", self.worker_id, shard
            )
            return
        want = ShardExpectations(
            job=self.job,
            shard=shard,
            cut_shape=self.template.cut_shape(cuts[0]),
            num_classes=self.settings.model.num_classes,
            cut=cuts[0],
            other_cuts={c: self.template.cut_shape(c) for c in cuts[1:]},
        )
        queue = shard_queue_name(self.job, shard)
        self.runners[queue] = ShardRunner(replica, want, self.policy, self.services)
        self.broker.subscribe(queue, prefetch=self.prefetch)
        self.stats.shards_acquired += 1
        self.log.info(
            "worker %s holds job %s shard %d (version %d, %d applied, round %d)",
            self.worker_id,
            self.job,
            shard,
            replica.version,
            replica.applied,
            replica.round,
        )

    def hand_over(self, runner: ShardRunner) -> None:
        queue = shard_queue_name(self.job, runner.shard)
        try:
            runner.checkpoint()
        except LeaseLostError:
            self.drop(runner.shard)
            return
        self.broker.unsubscribe(queue)
        del self.runners[queue]
        self.keeper.release(runner.shard)
        self.stats.shards_released += 1
        self.log.info(
            "worker %s handed over job %s shard %d", self.worker_id, self.job, runner.shard
        )

    def redeliver(self, shard: int) -> None:
        queue = shard_queue_name(self.job, shard)
        self.broker.unsubscribe(queue)
        self.broker.subscribe(queue, prefetch=self.prefetch)

    def drop(self, shard: int) -> None:
        """The lease is someone else's: forget the replica, give every delivery back."""
        queue = shard_queue_name(self.job, shard)
        self.unloaded.discard(shard)
        if self.runners.pop(queue, None) is None:
            return
        self.broker.unsubscribe(queue)
        self.stats.shards_lost += 1
        self.log.warning(
            "worker %s lost the lease of job %s shard %d", self.worker_id, self.job, shard
        )

    # --- deliveries ---------------------------------------------------------------------------
    def dispatch(self, delivery: Delivery) -> None:
        runner = self.runners.get(delivery.queue)
        if runner is None:  # not ours (any more): let the holder have it
            with contextlib.suppress(StaleDeliveryError):  # then it is back in the queue already
                self.broker.nack(delivery, requeue=True)
            return
        try:
            message = decode(delivery.body)
        except DecodeError as exc:
            reject(self.broker, delivery, "decode", exc.reason, self.stats, self.log)
            return
        if not isinstance(message, RoundStart | SmashedBatch | RoundEnd):
            detail = f"{type(message).__name__} does not belong on a shard queue"
            reject(self.broker, delivery, "wrong_type", detail, self.stats, self.log)
            return
        forged = (
            self.senders.client_problem(delivery, message.client)
            if isinstance(message, SmashedBatch)
            else self.senders.service_problem(delivery, type(message).__name__)
        )
        if forged is not None:
            reject(self.broker, delivery, "impostor", forged, self.stats, self.log)
            return
        context = log_context(shard=runner.shard, client=message.client or None)
        try:
            with context:
                runner.handle(delivery, message)
        except LeaseLostError:
            self.drop(runner.shard)

    def _each(self, action: Callable[[ShardRunner], None]) -> None:
        for runner in list(self.runners.values()):
            try:
                action(runner)
            except LeaseLostError:
                self.drop(runner.shard)

    def _timeout(self, now: float) -> float:
        if not self.barrier and any(r.buffered() for r in self.runners.values()):
            return 0.0  # fold only what is already waiting: look, don't wait
        until = [self.next_tick, now + self.poll_s]
        until += [d for r in self.runners.values() if (d := r.deadline()) is not None]
        return max(0.0, min(until) - now)

    def _drained(self) -> bool:
        """Burst mode: our share of shards held and loaded, nothing buffered, nothing queued.

        (A burst worker that can never get its share, W > S, runs until `stop`.)"""
        if self.unloaded or len(self.runners) < self.target:
            return False
        if any(r.buffered() for r in self.runners.values()):
            return False
        return all(self.broker.queue_depth(q) == 0 for q in self.runners)
