"""What a shard runner is handed by its worker (`ShardIO`: everything it reaches beyond its
replica, built once per `Worker.run`) and the unit it buffers (`Item`). Each runner gets these
instead of the worker's session, so its reach is this list and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.messages import SmashedBatch
from broker.store import WeightStore
from broker.transport import Delivery
from services.algorithms.base import ServerSide
from services.algorithms.recipe import LossFn
from services.common.schedule import BatchKey
from services.metrics.recorder import Metrics
from services.security.identity import SenderCheck
from workers.device_io import DevicePlane
from workers.gate import StepRule
from workers.members import MemberCache
from workers.replies import Replier
from workers.stats import WorkerStats


@dataclass(frozen=True)
class ShardLimits:
    """The job's settings a runner steps and checkpoints by."""

    batch_messages: int  # batches folded into one step (`workers.batch_messages`)
    step_timeout_s: float  # a step barrier's or an open U-shaped step's wait
    checkpoint_every_steps: int
    checkpoint_every_s: float
    pending_limit: int  # unacked deliveries that force a checkpoint: prefetch is finite
    rule: StepRule  # a client's batches per round (`workers.gate`)
    # `job.deterministic`: a sync round's batches served in one canonical order whatever order
    # they arrive in (`workers.sequencer`).
    deterministic: bool


@dataclass(frozen=True)
class ShardIO:
    """A runner's I/O, shared by the runners of one worker: the broker, store and lease
    operations it may call, its reply step and the counters it keeps."""

    worker_id: str
    server_side: ServerSide
    loss: LossFn
    limits: ShardLimits
    store: WeightStore  # a `ScheduleStore` too: the shard's schedule stream is written there
    replier: Replier
    plane: DevicePlane
    members: MemberCache
    senders: SenderCheck  # who may send a client's messages, and the markers
    stats: WorkerStats
    metrics: Metrics
    clock: Callable[[], float]
    log: logging.Logger
    ack: Callable[[Delivery], None]  # raises `StaleDeliveryError` after a reconnect
    refuse: Callable[[Delivery, str], None]  # dead-letter with a reason (`Rejection.reason`)
    renew: Callable[[int], bool]  # the shard's lease: whether it is still ours
    redeliver: Callable[[int], None]  # re-subscribe to the shard's queue
    # A replay's recorded batch order per shard (`workers.sequencer.RecordedOrder`); empty
    # in a run.
    scripts: Mapping[int, Sequence[BatchKey]] = field(default_factory=dict)


@dataclass(frozen=True)
class Item:
    """A valid batch waiting to be served, with the delivery to ack once it is checkpointed."""

    delivery: Delivery
    batch: SmashedBatch
