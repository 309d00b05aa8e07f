"""The asynchronous (FedBuff-style) clock of one aggregator run: no rounds, only versions.

Updates arrive whenever clients finish a local round. The `AsyncGate` buffers each one that is
at most `max_staleness` versions behind (a staler one is refused with `Error("too_stale")`);
when `buffer_size` (K) are buffered they are folded into version v+1 (each rebased onto the
current weights with its change scaled by s(tau), then the strategy's own `aggregate`, see
`services.algorithms.async_fold`), together with the shard replicas' fresh progress
(`services.common.server_fold`). Every client whose update was judged then gets the
newest weights as a WeightsAssignment, so it trains its next local round without waiting
for anyone. The job ends after `job.rounds` versions, as in sync mode, or fails when
`asynchronous.max_fruitless_per_client` local rounds per client in a row came to nothing
(dropped by their client, or refused) with no update buffered in between.

Buffered updates stay unacknowledged until the version holding them is published; each
version's manifest names the message ids it folded, so a successor that gets them redelivered
folds none twice.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from broker.errors import UnroutableError, VersionConflictError, VersionNotFoundError
from broker.messages import WeightsAssignment, new_message_id
from broker.store import (
    CLIENT_PART,
    JOB_FAILED,
    JOB_FINISHED,
    SERVER_PART,
    BlobRef,
    JobStatus,
    WeightStore,
)
from services.aggregator.async_gate import AsyncGate, Buffered
from services.aggregator.closing import read_version
from services.aggregator.evaluation import Evaluator
from services.aggregator.inbox import UpdateInbox
from services.aggregator.metrics import RoundTraffic, build_record, event_data
from services.aggregator.notices import end_job
from services.algorithms.async_fold import fold
from services.algorithms.base import (
    ShardReplica,
    Strategy,
    VersionWeights,
    personal_on_clients,
)
from services.algorithms.staleness import StalenessRule
from services.common.handout import WeightsCache, client_config
from services.common.membership import MemberInfo
from services.common.outbox import Outbox
from services.common.server_fold import FoldedCheckpoint, ServerLedger
from services.common.supervise import JobFailedError
from services.config.root import Settings
from services.report.records import MetricsSink, VersionRecord

# How often the members' records are re-read (an unknown sender triggers a re-read at once).
_MEMBER_CHECK_S = 1.0
# Manifest meta key: the message ids of the updates a version folded.
FOLDED_IDS = "message_ids"
# VersionRecord.extra keys: `staleness.<tau>` counts the folded updates by staleness.
STALENESS_PREFIX = "staleness."


def staleness_rule(settings: Settings) -> StalenessRule:
    a = settings.asynchronous
    return StalenessRule(a.staleness, a.a, a.b, a.max_staleness)


def staleness_extra(taus: Sequence[int], refused: int, buffer_size: int) -> dict[str, float]:
    """A version's staleness columns: the histogram of its folded updates and the refusals."""
    counts = Counter(taus)
    extra = {f"{STALENESS_PREFIX}{tau}": float(n) for tau, n in sorted(counts.items())}
    extra["staleness_mean"] = sum(taus) / len(taus) if taus else 0.0
    extra["staleness_max"] = float(max(taus, default=0))
    extra["too_stale"] = float(refused)
    extra["buffer_size"] = float(buffer_size)
    return extra


@dataclass
class AsyncStats:
    versions: int = 0
    folded: int = 0  # updates folded into versions
    too_stale: int = 0  # updates refused for staleness
    conflicts: int = 0  # versions another aggregator published first
    unfolded_at_end: int = 0  # buffered when the job ended
    assignments: int = 0


class BufferedDriver:
    def __init__(
        self,
        settings: Settings,
        store: WeightStore,
        outbox: Outbox,
        inbox: UpdateInbox,
        strategy: Strategy,
        *,
        stats: AsyncStats,
        sink: MetricsSink,
        evaluator: Evaluator | None,
        clock: Callable[[], float],
        stop: threading.Event,
        logger: logging.Logger,
        poll_s: float,
    ) -> None:
        self._settings = settings
        self._store = store
        self._outbox = outbox
        self._inbox = inbox
        self._strategy = strategy
        self._sink = sink
        self._evaluator = evaluator
        self._clock = clock
        self._stop = stop
        self._log = logger
        self._poll_s = poll_s
        self._job = settings.job.name
        self._k = settings.buffer_size
        self._fruitless_limit = (
            settings.asynchronous.max_fruitless_per_client * settings.clients.count
        )
        self._rule = staleness_rule(settings)
        self.stats = stats
        self._members = inbox.screen.members
        self._members_at = float("-inf")
        self._gate = AsyncGate(store, self._job, self._rule, self._member)
        self._server = ServerLedger(store, self._job, settings.shards, logger)
        self._started = clock()
        self._version_at = self._started
        self._bytes_at = 0
        self._assignment_bytes = 0

    # --- the loop -----------------------------------------------------------------------------
    def run(self) -> tuple[list[VersionRecord], str]:
        records: list[VersionRecord] = []
        version = self._store.current_version(self._job)
        self._resume(version)
        while not self._stop.is_set():
            if version - 1 >= self._settings.job.rounds:
                self._finish(version)
                return records, "finished"
            self._inbox.poll(self._poll_s, self._gate, version)
            self._check_progress(version)
            if len(self._gate.buffer) >= self._k:
                record = self._fold(version)
                if record is not None:
                    records.append(record)
                version = self._store.current_version(self._job)
                self._gate.at(version)
                if version - 1 >= self._settings.job.rounds:
                    continue  # the last version: the members are dismissed, not assigned
            self._answer(version)
        return records, "stopped"

    def _resume(self, version: int) -> None:
        """Start at `version`: what recent versions folded is never folded again."""
        self._gate.at(version)
        kept = [
            v for v in self._store.versions(self._job) if v > version - self._rule.max_staleness - 2
        ]
        for v in kept:
            try:
                meta = self._store.manifest(self._job, v).meta
            except VersionNotFoundError:
                continue
            self._gate.remember([m for m in meta.get(FOLDED_IDS, "").split(",") if m])
            if v == version:
                self._server.restore(meta)
        self._log.info(
            "job %s: asynchronous at version %d (K=%d, %s staleness, max %d)",
            self._job,
            version,
            self._k,
            self._rule.kind,
            self._rule.max_staleness,
        )

    def _member(self, client: str) -> MemberInfo | None:
        now = self._clock()
        if now - self._members_at >= _MEMBER_CHECK_S:
            # Fresh records (a member's partition, its classes) now and then; members that
            # left keep their record in the book: an update sent just before a Leave is as
            # good as any.
            self._members.live()
            self._members_at = now
        return self._members.get(client)

    # --- folding ------------------------------------------------------------------------------
    def _fold(self, version: int) -> VersionRecord | None:
        buffered = self._gate.take()
        refused, self._gate.too_stale = self._gate.too_stale, 0
        current = read_version(self._store, self._job, version)
        replicas: list[ShardReplica] = []
        taken: dict[int, FoldedCheckpoint] = {}
        if self._strategy.splits and BlobRef(SERVER_PART) in current:
            replicas, taken = self._server.fresh(current[BlobRef(SERVER_PART)])
        blobs = fold(self._strategy, current, [b.stale for b in buffered], self._rule, replicas)
        updates = [b.stale.update for b in buffered]
        samples = {BlobRef(CLIENT_PART): sum(u.samples for u in updates)}
        if replicas:
            samples[BlobRef(SERVER_PART)] = sum(r.samples for r in replicas)
        meta = {
            "round": str(version - 1),
            "mode": "async",
            "participants": ",".join(u.client for u in updates),
            "staleness": ",".join(str(b.stale.tau) for b in buffered),
            FOLDED_IDS: ",".join(b.message_id for b in buffered),
            **self._server.meta(taken),
        }
        try:
            published = self._store.publish_version(
                self._job,
                version,
                blobs,
                samples={ref: n for ref, n in samples.items() if ref in blobs},
                meta=meta,
            )
        except VersionConflictError as exc:
            self.stats.conflicts += 1
            self._log.warning(
                "job %s: version %d was published by another aggregator (now %d); "
                "dropping %d buffered updates",
                self._job,
                version + 1,
                exc.actual,
                len(buffered),
            )
            self._inbox.release()
            return None
        self._server.commit(taken)
        self._inbox.release()
        # The clients owed weights train on while this version is evaluated (after the last
        # version they are dismissed instead).
        self._gate.at(published)
        if published - 1 < self._settings.job.rounds:
            self._answer(published)
        self.stats.versions += 1
        self.stats.folded += len(buffered)
        self.stats.too_stale += refused
        return self._record(published, blobs, buffered, len(replicas), refused)

    def _record(
        self,
        version: int,
        blobs: VersionWeights,
        buffered: list[Buffered],
        replicas: int,
        refused: int,
    ) -> VersionRecord:
        now = self._clock()
        interval = now - self._version_at
        self._version_at = now
        updates = [b.stale.update for b in buffered]
        classes = {b.info.client: b.info.classes for b in buffered}
        evaluator = self._evaluator
        evaluation = evaluator.evaluate(blobs, classes) if evaluator else None
        own = evaluator.strategy_metrics(self._strategy, blobs, classes) if evaluator else {}
        accepted = self._inbox.stats.accepted_bytes
        traffic = RoundTraffic(
            round_s=interval,
            update_bytes=accepted - self._bytes_at,
            assignment_bytes=self._assignment_bytes,
            late_updates=refused,
        )
        self._bytes_at, self._assignment_bytes = accepted, 0
        record = build_record(
            version=version,
            round_index=version - 2,
            elapsed_s=now - self._started,
            updates=updates,
            traffic=traffic,
            evaluation=evaluation,
            personal_from_clients=personal_on_clients(self._strategy),
            strategy_metrics=own,
        )
        taus = [b.stale.tau for b in buffered]
        record.extra.update(staleness_extra(taus, refused, self._k))
        record.extra["replicas"] = float(replicas)
        self._sink.record(record)
        self._log.info(
            "job %s: version %d from %d updates (staleness %s), %d replicas; accuracy %.4f",
            self._job,
            version,
            len(updates),
            taus,
            replicas,
            record.global_accuracy,
        )
        self._outbox.event("version_published", version, event_data(record))
        return record

    # --- answers ------------------------------------------------------------------------------
    def _answer(self, version: int) -> None:
        """The newest weights to every member whose update was judged since the last call."""
        if not self._gate.owed:
            return
        owed, self._gate.owed = self._gate.owed, []
        weights = WeightsCache(self._store, self._job, version)
        for o in owed:
            client_weights, aux_weights = weights.for_client(o.client)
            assignment = WeightsAssignment(
                job=self._job,
                client=o.client,
                message_id=new_message_id(),
                version=version,
                round=o.next_round,
                participate=True,
                client_weights=client_weights,
                aux_weights=aux_weights,
                config=client_config(self._settings, o.partition),
            )
            try:
                self._assignment_bytes += self._outbox.reply(o.client, assignment)
                self.stats.assignments += 1
            except UnroutableError:
                self._log.info(
                    "job %s: client %s is gone; no new weights for it", self._job, o.client
                )

    def _check_progress(self, version: int) -> None:
        """Fail the job (raising `JobFailedError`) when too many local rounds in a row came to
        nothing: every client diverging, say, would retrain and drop for ever."""
        fruitless = self._gate.fruitless
        count = sum(fruitless.values())
        if not self._fruitless_limit or count < self._fruitless_limit:
            return
        reasons = ", ".join(f"{kind} ×{n}" for kind, n in sorted(fruitless.items()))
        reason = (
            f"{count} local rounds in a row came to nothing, with no update buffered in "
            f"between; reasons: {reasons}"
        )
        self._gate.take()
        self._gate.owed.clear()
        self._inbox.release()
        ended = JobStatus(JOB_FAILED, reason)
        end_job(self._store, self._outbox, self._settings, version, ended, self._log)
        self._log.error("job %s %s (version %d)", self._job, ended.text, version)
        raise JobFailedError(reason)

    def _finish(self, version: int) -> None:
        """Dismiss every live member; updates still buffered are acked and dropped."""
        self.stats.unfolded_at_end += len(self._gate.take())
        self._gate.owed.clear()
        self._inbox.release()
        end_job(
            self._store, self._outbox, self._settings, version, JobStatus(JOB_FINISHED), self._log
        )
        self._log.info(
            "job %s: finished after %d versions (version %d, %d updates left unfolded)",
            self._job,
            self._settings.job.rounds,
            version,
            self.stats.unfolded_at_end,
        )
