"""The sync round clock of one aggregator run (architecture steps 3, 6 and 7).

Round r trains version v = r + 1 (version 1 is the initial model), so the store's current
version alone says which round comes next: a restarted aggregator resumes where the last one
published, and a reopened round (no update arrived) publishes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from broker.errors import VersionConflictError
from broker.store import JOB_FAILED, JOB_FINISHED, JobStatus, WeightStore
from services.aggregator.closing import aggregate_and_publish
from services.aggregator.cohort import sample_cohort
from services.aggregator.empty import EmptyAttempt, EmptyStreak
from services.aggregator.evaluation import Evaluator
from services.aggregator.gate import ClosedGate, Decision, OpenRound, reference_of
from services.aggregator.inbox import UpdateInbox
from services.aggregator.metrics import RoundTraffic, build_record, event_data
from services.aggregator.notices import (
    announce_round,
    assign_round,
    cohort_shards,
    end_job,
    end_round,
)
from services.aggregator.replicas import gather_replicas
from services.algorithms.base import (
    ShardReplica,
    Strategy,
    personal_on_clients,
)
from services.common.handout import WeightsCache
from services.common.membership import MemberInfo
from services.common.outbox import Outbox
from services.common.supervise import JobFailedError
from services.config.root import Settings
from services.report.records import MetricsSink, VersionRecord

# How often the members' liveness is re-read while a round waits for updates.
_MEMBER_CHECK_S = 1.0


@dataclass
class RoundStats:
    rounds: int = 0
    reopened: int = 0
    conflicts: int = 0  # versions another aggregator published first


@dataclass
class _Ledger:
    """What one round exchanged, across its attempts."""

    assignment_bytes: int = 0
    late_at_open: int = 0
    bytes_at_open: int = 0


class RoundDriver:
    def __init__(
        self,
        settings: Settings,
        store: WeightStore,
        outbox: Outbox,
        inbox: UpdateInbox,
        strategy: Strategy,
        *,
        stats: RoundStats,
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
        # The inbox's book: a member put in a cohort is known to its screen.
        self._members = inbox.screen.members
        self._strategy = strategy
        self._sink = sink
        self._evaluator = evaluator
        self._clock = clock
        self._stop = stop
        self._log = logger
        self._poll_s = poll_s
        self._job = settings.job.name
        self._started = clock()
        self.stats = stats
        # Members already reported as not ready (no training samples): logged once each.
        self._unready: set[str] = set()

    def run_round(self, version: int) -> VersionRecord | None:
        """Train version `version` into the next; the record, or None when stopped or when
        another aggregator published first."""
        r = version - 1
        ledger = _Ledger(
            late_at_open=self._inbox.stats.late, bytes_at_open=self._inbox.stats.accepted_bytes
        )
        earlier: frozenset[str] = frozenset()
        attempt = 0
        streak = EmptyStreak(self._settings.rounds.max_empty_attempts)
        while not self._stop.is_set():
            state = self._open(version, attempt, earlier, ledger)
            if state is None:
                return None
            decision = self._collect(state)
            if decision is Decision.CLOSE:
                return self._close(state, ledger)
            if decision is None:
                return None
            empty = EmptyAttempt.of(state, self._inbox.refusals)
            if streak.add(empty):
                raise JobFailedError(streak.failure(r, empty))
            self.stats.reopened += 1
            self._log.warning(
                "job %s: round %d got no valid update (%s; %d of %s empty attempts in a row); "
                "reopening it",
                self._job,
                r,
                empty.reasons(),
                streak.count,
                streak.limit or "unlimited",
            )
            earlier = earlier | frozenset(state.cohort)
            attempt += 1
        return None

    # --- opening ------------------------------------------------------------------------------
    def _await_members(
        self, r: int, version: int, gate: ClosedGate
    ) -> dict[str, MemberInfo] | None:
        clients = self._settings.clients
        need = clients.min_to_start if r == 0 else 1
        since = self._clock()
        while not self._stop.is_set():
            ready = self._ready(self._members.live())
            timed_out = self._clock() - since >= clients.start_timeout_s
            if len(ready) >= need or (ready and timed_out):
                return ready
            # Polling the updates queue doubles as the wait, and answers late updates meanwhile.
            self._inbox.poll(self._poll_s, gate, version)
        return None

    def _ready(self, live: dict[str, MemberInfo]) -> dict[str, MemberInfo]:
        """The members a round can count on: those with training samples (`MemberInfo.ready`).
        The others wait out of the cohorts (and are dismissed with the rest at the end)."""
        ready = {c: m for c, m in live.items() if m.ready}
        for client in sorted(live.keys() - ready.keys() - self._unready):
            self._unready.add(client)
            self._log.info(
                "job %s: client %s (partition %d) has no training samples (yet): it is left "
                "out of the cohorts until it reports some",
                self._job,
                client,
                live[client].partition,
            )
        return ready

    def _open(
        self, version: int, attempt: int, earlier: frozenset[str], ledger: _Ledger
    ) -> OpenRound | None:
        r = version - 1
        # Before round r opens, its updates can only come from an earlier attempt at it (this
        # run's, or a predecessor's): late, not malformed.
        live = self._await_members(r, version, ClosedGate(r))
        if live is None:
            return None
        chosen = sample_cohort(
            live,
            self._settings.clients.fraction,
            seed=self._settings.job.seed,
            round_index=r,
            attempt=attempt,
        )
        cohort = {c: live[c] for c in chosen}
        weights = WeightsCache(self._store, self._job, version)
        global_client, global_aux = weights.global_weights()
        client_ref, aux_ref = reference_of(global_client), reference_of(global_aux)
        if self._strategy.splits and not announce_round(
            self._outbox, self._job, version, cohort, self._stop
        ):
            return None
        # Refusals count per attempt: the ones before it belong to an earlier one.
        self._inbox.refusals.clear()
        state = OpenRound(
            round=r,
            version=version,
            cohort=cohort,
            opened_at=self._clock(),
            deadline_s=self._settings.rounds.deadline_s,
            quorum=self._settings.rounds.quorum,
            client_ref=client_ref,
            aux_ref=aux_ref,
            earlier=earlier,
        )
        assigned = assign_round(self._outbox, self._settings, weights, cohort, self._log)
        ledger.assignment_bytes += assigned.bytes_sent
        state.dropped.update(assigned.unreachable)
        state.assigned.update(assigned.message_ids)
        self._log.info(
            "job %s: round %d opened (version %d, cohort %s)", self._job, r, version, sorted(cohort)
        )
        self._outbox.event(
            "round_opened", version, {"round": r, "cohort": len(cohort), "attempt": attempt}
        )
        return state

    # --- collecting ---------------------------------------------------------------------------
    def _collect(self, state: OpenRound) -> Decision | None:
        """Take updates until the round closes or must reopen; None when stopped."""
        last_check = state.opened_at
        while not self._stop.is_set():
            self._inbox.poll(self._poll_s, state, state.version)
            now = self._clock()
            if now - last_check >= _MEMBER_CHECK_S:
                last_check = now
                live = self._members.live()
                for client in state.drop(live):
                    self._log.info(
                        "job %s: round %d stops waiting for %s (%s)",
                        self._job,
                        state.round,
                        client,
                        "rejoined as a new process" if client in live else "left or expired",
                    )
            if state.decide(now) is not Decision.WAIT:
                # Updates already queued at the deadline still count.
                self._inbox.drain(state, state.version)
                return state.decide(self._clock())
        return None

    # --- closing ------------------------------------------------------------------------------
    def _close(self, state: OpenRound, ledger: _Ledger) -> VersionRecord | None:
        round_s = self._clock() - state.opened_at
        replicas = self._replicas(state)
        if replicas is None:
            return None
        try:
            published = aggregate_and_publish(
                self._store, self._job, self._strategy, state, replicas
            )
        except VersionConflictError as exc:
            self.stats.conflicts += 1
            self._log.warning(
                "job %s: version %d was published by another aggregator (now %d); "
                "dropping round %d",
                self._job,
                state.version + 1,
                exc.actual,
                state.round,
            )
            self._inbox.release()
            return None
        self._inbox.release()
        self.stats.rounds += 1
        classes = {c: info.classes for c, info in state.cohort.items()}
        evaluator = self._evaluator
        evaluation = evaluator.evaluate(published.blobs, classes) if evaluator else None
        own = (
            evaluator.strategy_metrics(self._strategy, published.blobs, classes)
            if evaluator
            else {}
        )
        traffic = RoundTraffic(
            round_s=round_s,
            update_bytes=self._inbox.stats.accepted_bytes - ledger.bytes_at_open,
            assignment_bytes=ledger.assignment_bytes,
            late_updates=self._inbox.stats.late - ledger.late_at_open,
        )
        record = build_record(
            version=published.version,
            round_index=state.round,
            elapsed_s=self._clock() - self._started,
            updates=published.updates,
            traffic=traffic,
            evaluation=evaluation,
            personal_from_clients=personal_on_clients(self._strategy),
            strategy_metrics=own,
        )
        self._sink.record(record)
        self._log.info(
            "job %s: round %d closed: version %d from %d updates, %d replicas; accuracy %.4f",
            self._job,
            state.round,
            published.version,
            len(published.updates),
            len(replicas),
            record.global_accuracy,
        )
        self._outbox.event("version_published", published.version, event_data(record))
        return record

    def _replicas(self, state: OpenRound) -> list[ShardReplica] | None:
        if not self._strategy.splits:
            return []
        shards = list(cohort_shards(state.cohort))
        if not end_round(self._outbox, self._job, state.version, shards, self._stop):
            return None
        return gather_replicas(
            self._store,
            self._job,
            shards,
            state.round,
            timeout_s=self._settings.rounds.replica_timeout_s,
            clock=self._clock,
            stop=self._stop,
            logger=self._log,
        )

    # --- the end ------------------------------------------------------------------------------
    def finish(self, version: int) -> None:
        """Tell every live member the job is over (architecture step 7)."""
        rounds = self._settings.job.rounds
        end_job(
            self._store, self._outbox, self._settings, version, JobStatus(JOB_FINISHED), self._log
        )
        self._log.info("job %s: finished after %d rounds (version %d)", self._job, rounds, version)

    def fail(self, version: int, reason: str) -> None:
        """End the job as failed: every live member is dismissed as when it finishes, with the
        status in the dismissal, so clients stop the same way."""
        ended = JobStatus(JOB_FAILED, reason)
        end_job(self._store, self._outbox, self._settings, version, ended, self._log)
        self._log.error("job %s %s (version %d)", self._job, ended.text, version)
