"""The aggregator's core, one for both modes: the loop to the job's end, the publication of a
version (architecture step 6), its record, and the end of the job (step 7).

The clock, a subclass of `Core` (`rounds.RoundClock` or `buffered.BufferClock`), judges updates
through its gate and decides when a version is due and what goes into it; the core publishes it
by compare-and-set, acks the updates it holds, evaluates and records it. Round r trains version
r + 1, so a restarted aggregator resumes from the store's current version alone.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from broker.errors import UnroutableError, VersionConflictError
from broker.store import (
    CLIENT_PART,
    JOB_FAILED,
    JOB_FINISHED,
    SERVER_PART,
    BlobRef,
    JobStatus,
    WeightStore,
)
from services.aggregator.evaluation import Evaluator
from services.aggregator.gate import MemberBook
from services.aggregator.inbox import UpdateInbox
from services.aggregator.metrics import build_record, event_data, own_model_accuracy
from services.algorithms.base import (
    ClientUpdate,
    ShardReplica,
    Strategy,
    VersionWeights,
)
from services.common.handout import WeightsCache, assignment, dismissal
from services.common.membership import client_members
from services.common.outbox import Outbox
from services.common.schedule import (
    AGGREGATOR_STREAM,
    Folded,
    FoldedUpdate,
    MemberEvent,
    ScheduleLog,
    weights_digest,
)
from services.common.supervise import JobFailedError
from services.config.root import Settings
from services.report.records import OWN_MODEL_ACCURACY, MetricsSink, VersionRecord


@dataclass
class Stats:
    versions: int = 0
    conflicts: int = 0  # versions another aggregator published first
    reopened: int = 0  # sync: attempts at a round that got no valid update
    late_replicas: int = 0  # sync: rounds whose replicas came after replica_timeout_s
    folded: int = 0  # async: updates folded into versions
    too_stale: int = 0  # async: updates refused for staleness
    unfolded_at_end: int = 0  # async: buffered when the job ended


def read_version(store: WeightStore, job: str, version: int) -> VersionWeights:
    return {ref: store.read_blob(job, version, ref) for ref in store.manifest(job, version).entries}


@dataclass
class Core(ABC):
    settings: Settings
    store: WeightStore
    outbox: Outbox
    inbox: UpdateInbox
    strategy: Strategy
    sink: MetricsSink
    evaluator: Evaluator | None
    clock: Callable[[], float]
    stop: threading.Event
    log: logging.Logger
    poll_s: float
    stats: Stats
    records: list[VersionRecord] = field(default_factory=list)
    # What was exchanged since `mark`: assignments out (bytes), updates in and late (counts).
    assignment_bytes: int = 0
    _bytes_at: int = 0
    _late_at: int = 0
    _started: float = 0.0
    # Each client's latest own-model accuracy (`own_model_accuracy`): one float per client
    # that has reported, bounded by the members.
    _own: dict[str, float] = field(default_factory=dict)
    # The aggregator's stream of the run's schedule record: a `Folded` per version published.
    schedule: ScheduleLog = field(init=False)

    def __post_init__(self) -> None:
        self._started = self.clock()
        self.schedule = ScheduleLog(self.store, self.job, AGGREGATOR_STREAM)

    @property
    def job(self) -> str:
        return self.settings.job.name

    @property
    def members(self) -> MemberBook:
        """The inbox's book: a member a clock puts in a cohort is known to its screen."""
        return self.inbox.screen.members

    @abstractmethod
    def start(self, version: int) -> None:
        """Resume at the store's current `version`."""

    @abstractmethod
    def step(self, version: int) -> int:
        """Take updates until a version is published, or for one poll; the version now.
        Raises `JobFailedError` when the job cannot make progress."""

    def abandon(self) -> int:
        """The job ends: forget the updates held (the core acks them); how many there were
        (sync: none, between rounds)."""
        return 0

    def run(self) -> tuple[list[VersionRecord], str]:
        """The clock's versions until `job.rounds` are trained (or `stop`); the records and how
        the run ended. A `JobFailedError` ends the job as failed, then propagates."""
        version = self.store.current_version(self.job)
        self.start(version)
        while not self.stop.is_set():
            if version - 1 >= self.settings.job.rounds:
                self.end(version, JobStatus(JOB_FINISHED))
                return self.records, "finished"
            try:
                version = self.step(version)
            except JobFailedError as exc:
                self.end(version, JobStatus(JOB_FAILED, str(exc)))
                raise
        return self.records, "stopped"

    def mark(self) -> None:
        """Start counting the traffic of the next record from now."""
        self.assignment_bytes = 0
        self._bytes_at = self.inbox.stats.accepted_bytes
        self._late_at = self.inbox.stats.late

    def assign(self, weights: WeightsCache, client: str, partition: int, round_index: int) -> str:
        """Send `client` the weights for its next round; the message id ("" when the client has
        no reply queue: it is gone)."""
        message = assignment(self.settings, weights, client, partition, round_index)
        try:
            self.assignment_bytes += self.outbox.reply(client, message)
        except UnroutableError:
            self.log.warning("job %s: client %s has no reply queue; it is gone", self.job, client)
            return ""
        return message.message_id

    def commit(
        self,
        base: int,
        blobs: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
        meta: Mapping[str, str],
        *,
        folded: Sequence[FoldedUpdate],
        applied: Sequence[tuple[int, int]],
        cohort: Sequence[str] = (),
    ) -> int | None:
        """Publish `blobs` as the version after `base` and ack the updates held; None when
        another aggregator published that version first (the updates are acked and lost).

        A published version is recorded (`Folded`: `folded`, the updates in fold order;
        `applied`, (shard, applied count) of each replica) and the record written before this
        returns, so before the next round opens or the next fold starts."""
        samples = {BlobRef(CLIENT_PART): sum(u.samples for u in updates)}
        if replicas:
            samples[BlobRef(SERVER_PART)] = sum(r.samples for r in replicas)
        participants = ",".join(u.client for u in updates)
        try:
            version = self.store.publish_version(
                self.job,
                base,
                blobs,
                samples={ref: n for ref, n in samples.items() if ref in blobs},
                meta={"round": str(base - 1), "participants": participants, **meta},
            )
        except VersionConflictError as exc:
            self.stats.conflicts += 1
            self.log.warning(
                "job %s: version %d was published by another aggregator (now %d); dropping "
                "round %d (%d updates)",
                self.job,
                base + 1,
                exc.actual,
                base,
                len(updates),
            )
            self.inbox.release()
            return None
        self.inbox.release()
        self.stats.versions += 1
        digest = weights_digest(blobs)  # the blobs are what was published, bit for bit
        entry = Folded(version, base - 1, tuple(folded), tuple(applied), digest, tuple(cohort))
        self.schedule.add(entry)
        self.schedule.flush()
        return version

    def dropped_round(self, client: str, round_index: int) -> None:
        """Record a member's accepted `RoundDropped` (written with the next version)."""
        self.schedule.add(MemberEvent("dropped_round", client, round_index))

    def record(
        self,
        version: int,
        blobs: VersionWeights,
        updates: Sequence[ClientUpdate],
        classes: Mapping[str, Sequence[int]],
        *,
        round_s: float,
        replicas: int,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Evaluate a published version, record it, announce it; counts traffic from `mark`."""
        evaluator = self.evaluator
        evaluation = evaluator.evaluate(blobs, classes) if evaluator else None
        own = evaluator.strategy_metrics(self.strategy, blobs, classes) if evaluator else {}
        stats = self.inbox.stats
        record = build_record(
            version=version,
            round_index=version - 2,
            elapsed_s=self.clock() - self._started,
            updates=updates,
            evaluation=evaluation,
            round_s=round_s,
            update_bytes=stats.accepted_bytes - self._bytes_at,
            assignment_bytes=self.assignment_bytes,
            late_updates=stats.late - self._late_at,
            personal_from_clients=self.strategy.traits.personal_on_clients,
            strategy_metrics=own,
        )
        record.extra.update(extra or {})
        own_accuracy = own_model_accuracy(self._own, updates)
        if own_accuracy == own_accuracy:
            record.extra[OWN_MODEL_ACCURACY] = own_accuracy
        self.mark()
        self.sink.record(record)
        self.log.info(
            "job %s: round %d closed: version %d from %d updates, %d replicas; accuracy %.4f",
            self.job,
            version - 1,
            version,
            len(updates),
            replicas,
            record.global_accuracy,
        )
        self.outbox.event("version_published", version, event_data(record))
        self.records.append(record)

    def end(self, version: int, ended: JobStatus) -> None:
        """Record how the job ended, dismiss every live member with that status and announce it;
        updates still held are acked and dropped. The record comes before the members are read
        (the coordinator's half of that race: `JoinDesk.join`)."""
        self.stats.unfolded_at_end += self.abandon()
        self.inbox.release()
        self.store.set_job_status(self.job, ended)
        for client in sorted(client_members(self.store, self.job)):
            try:
                self.outbox.reply(client, dismissal(self.settings, client, version, ended.text))
            except UnroutableError:
                self.log.info("job %s: finished client %s has no reply queue", self.job, client)
        rounds = self.settings.job.rounds
        self.outbox.event("job_finished", version, {"rounds": rounds, "status": ended.text})
        if ended.state == JOB_FAILED:
            self.log.error("job %s %s (version %d)", self.job, ended.text, version)
        else:
            self.log.info(
                "job %s: finished after %d rounds (version %d, %d updates left unfolded)",
                self.job,
                rounds,
                version,
                self.stats.unfolded_at_end,
            )
