"""What the autoscaler looks at: ready messages per shard queue, and the workers' heartbeats.

Depth comes from the broker (`queue_depth`: on RabbitMQ a passive queue.declare, whose
message_count is the ready messages; no management plugin needed). It misses what workers
hold unacked in their prefetch window, which is why the workers' busy fraction, from the
`busy` field of their `worker:<id>` heartbeat (workers/busy.py), is the second signal.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.keys import WORKER_MEMBER_PREFIX
from broker.store import Member, WeightStore
from broker.topology import QueueLimits, job_queues, shard_queue_name
from broker.transport import Broker


@dataclass(frozen=True)
class WorkerReport:
    worker_id: str
    shards: tuple[int, ...]
    busy: float | None


def parse_report(member: Member) -> WorkerReport | None:
    """A `worker:<id>` member's heartbeat; None for other members. Bad fields read as absent."""
    if not member.member_id.startswith(WORKER_MEMBER_PREFIX):
        return None
    info = member.info
    try:
        shards = tuple(int(s) for s in info.get("shards", "").split(",") if s)
    except ValueError:
        shards = ()
    try:
        busy: float | None = min(1.0, max(0.0, float(info["busy"])))
    except (KeyError, ValueError):
        busy = None
    return WorkerReport(member.member_id[len(WORKER_MEMBER_PREFIX) :], shards, busy)


@dataclass(frozen=True)
class Snapshot:
    depths: dict[int, int]  # ready messages by shard
    workers: dict[str, WorkerReport]  # live workers by id

    @property
    def depth(self) -> int:
        return sum(self.depths.values())

    @property
    def busy(self) -> float | None:
        """Mean busy fraction of the workers that report one."""
        values = [w.busy for w in self.workers.values() if w.busy is not None]
        return sum(values) / len(values) if values else None


class Observer:
    """Reads one job's shard queues and worker heartbeats; owns neither handle."""

    def __init__(
        self, broker: Broker, store: WeightStore, job: str, shards: int, limits: QueueLimits
    ) -> None:
        self._broker = broker
        self._store = store
        self._job = job
        self._shards = shards
        self._limits = limits
        self._declared = False

    def snapshot(self) -> Snapshot:
        if not self._declared:
            # Idempotent, with the workers' own arguments: a passive declare of a queue that
            # does not exist yet would close the channel.
            self._broker.declare(job_queues(self._job, self._shards, self._limits))
            self._declared = True
        try:
            depths = {
                s: self._broker.queue_depth(shard_queue_name(self._job, s))
                for s in range(self._shards)
            }
        except Exception:
            self._declared = False  # e.g. a queue deleted under us: declare again next time
            raise
        workers = {}
        for member in self._store.live_members(self._job).values():
            report = parse_report(member)
            if report is not None:
                workers[report.worker_id] = report
        return Snapshot(depths, workers)
