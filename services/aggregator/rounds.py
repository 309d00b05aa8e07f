"""The sync round clock of one aggregator run (architecture steps 3, 6 and 7).

Round r trains version v = r + 1 (version 1 is the initial model), so the store's current
version alone says which round comes next: a restarted aggregator resumes where the last one
published, and a reopened round (no update arrived) publishes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from broker.errors import UnroutableError, VersionConflictError
from broker.messages import ConfigValue, RoundEnd, RoundStart, WeightsAssignment, new_message_id
from broker.store import CLIENT_PART, SERVER_PART, BlobRef, WeightStore
from services.aggregator.cohort import sample_cohort
from services.aggregator.evaluation import Evaluator
from services.aggregator.gate import ClosedGate, Decision, OpenRound, reference_of
from services.aggregator.inbox import UpdateInbox
from services.aggregator.metrics import RoundTraffic, build_record
from services.aggregator.replicas import gather_replicas
from services.algorithms.base import ShardReplica, Strategy
from services.config.root import Settings
from services.coordinator.handout import WeightsCache, client_config
from services.coordinator.membership import MemberInfo, client_members
from services.coordinator.outbox import Outbox
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
        self._started = clock()
        self.stats = RoundStats()

    def run_round(self, version: int) -> VersionRecord | None:
        """Train version `version` into the next; the record, or None when stopped or when
        another aggregator published first."""
        r = version - 1
        ledger = _Ledger(
            late_at_open=self._inbox.stats.late, bytes_at_open=self._inbox.stats.accepted_bytes
        )
        earlier: frozenset[str] = frozenset()
        attempt = 0
        while not self._stop.is_set():
            state = self._open(version, attempt, earlier, ledger)
            if state is None:
                return None
            decision = self._collect(state)
            if decision is Decision.CLOSE:
                return self._close(state, ledger)
            if decision is None:
                return None
            self.stats.reopened += 1
            self._log.warning("job %s: round %d got no update; reopening it", self._job, r)
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
            live = client_members(self._store, self._job)
            timed_out = self._clock() - since >= clients.start_timeout_s
            if len(live) >= need or (live and timed_out):
                return live
            # Polling the updates queue doubles as the wait, and answers late updates meanwhile.
            self._inbox.poll(self._poll_s, gate, version)
        return None

    def _open(
        self, version: int, attempt: int, earlier: frozenset[str], ledger: _Ledger
    ) -> OpenRound | None:
        r = version - 1
        gate = ClosedGate(r if attempt else r - 1)
        live = self._await_members(r, version, gate)
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
        if self._strategy.splits and not self._announce(version, cohort):
            return None
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
        for client, info in cohort.items():
            client_weights, aux_weights = weights.for_client(client)
            assignment = WeightsAssignment(
                job=self._job,
                client=client,
                message_id=new_message_id(),
                version=version,
                round=r,
                participate=True,
                client_weights=client_weights,
                aux_weights=aux_weights,
                config=client_config(self._settings, info.partition),
            )
            try:
                ledger.assignment_bytes += self._outbox.reply(client, assignment)
            except UnroutableError:
                self._log.warning(
                    "job %s: client %s has no reply queue; not waiting for it", self._job, client
                )
                state.dropped.add(client)
        self._log.info(
            "job %s: round %d opened (version %d, cohort %s)", self._job, r, version, sorted(cohort)
        )
        self._outbox.event(
            "round_opened", version, {"round": r, "cohort": len(cohort), "attempt": attempt}
        )
        return state

    def _announce(self, version: int, cohort: Mapping[str, MemberInfo]) -> bool:
        """RoundStart to every shard with cohort members, ahead of the round's batches."""
        by_shard: dict[int, dict[str, ConfigValue]] = {}
        for client, info in sorted(cohort.items()):
            by_shard.setdefault(info.shard, {})[client] = info.samples
        for shard, participants in sorted(by_shard.items()):
            start = RoundStart(
                self._job, "", new_message_id(), version, version - 1, shard, participants
            )
            if not self._outbox.to_shard(shard, start, self._stop):
                return False
        return True

    # --- collecting ---------------------------------------------------------------------------
    def _collect(self, state: OpenRound) -> Decision | None:
        """Take updates until the round closes or must reopen; None when stopped."""
        last_check = state.opened_at
        while not self._stop.is_set():
            self._inbox.poll(self._poll_s, state, state.version)
            now = self._clock()
            if now - last_check >= _MEMBER_CHECK_S:
                last_check = now
                for client in state.drop(client_members(self._store, self._job)):
                    self._log.info(
                        "job %s: round %d stops waiting for expired %s",
                        self._job,
                        state.round,
                        client,
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
        version = state.version
        previous = {
            ref: self._store.read_blob(self._job, version, ref)
            for ref in self._store.manifest(self._job, version).entries
        }
        updates = [state.updates[c] for c in sorted(state.updates)]
        blobs = self._strategy.aggregate(previous, updates, replicas)
        samples = {BlobRef(CLIENT_PART): sum(u.samples for u in updates)}
        if replicas:
            samples[BlobRef(SERVER_PART)] = sum(r.samples for r in replicas)
        meta = {"round": str(state.round), "participants": ",".join(sorted(state.updates))}
        try:
            published = self._store.publish_version(
                self._job,
                version,
                blobs,
                samples={k: v for k, v in samples.items() if k in blobs},
                meta=meta,
            )
        except VersionConflictError as exc:
            self.stats.conflicts += 1
            self._log.warning(
                "job %s: version %d was published by another aggregator (now %d); "
                "dropping round %d",
                self._job,
                version + 1,
                exc.actual,
                state.round,
            )
            self._inbox.release()
            return None
        self._inbox.release()
        self.stats.rounds += 1
        classes = {c: info.classes for c, info in state.cohort.items()}
        evaluation = self._evaluator.evaluate(blobs, classes) if self._evaluator else None
        traffic = RoundTraffic(
            round_s=round_s,
            update_bytes=self._inbox.stats.accepted_bytes - ledger.bytes_at_open,
            assignment_bytes=ledger.assignment_bytes,
            late_updates=self._inbox.stats.late - ledger.late_at_open,
        )
        record = build_record(
            version=published,
            round_index=state.round,
            elapsed_s=self._clock() - self._started,
            updates=updates,
            traffic=traffic,
            evaluation=evaluation,
        )
        self._sink.record(record)
        self._log.info(
            "job %s: round %d closed: version %d from %d updates, %d replicas; accuracy %.4f",
            self._job,
            state.round,
            published,
            len(updates),
            len(replicas),
            record.global_accuracy,
        )
        self._outbox.event("version_published", published, _event_data(record))
        return record

    def _replicas(self, state: OpenRound) -> list[ShardReplica] | None:
        if not self._strategy.splits:
            return []
        shards = sorted({info.shard for info in state.cohort.values()})
        for shard in shards:
            end = RoundEnd(self._job, "", new_message_id(), state.version, state.round, shard)
            if not self._outbox.to_shard(shard, end, self._stop):
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
        for client in sorted(client_members(self._store, self._job)):
            done = WeightsAssignment(
                self._job,
                client,
                new_message_id(),
                version,
                rounds,
                False,
                {},
                {},
                {"finished": True},
            )
            try:
                self._outbox.reply(client, done)
            except UnroutableError:
                self._log.info("job %s: finished client %s has no reply queue", self._job, client)
        self._outbox.event("job_finished", version, {"rounds": rounds})
        self._log.info("job %s: finished after %d rounds (version %d)", self._job, rounds, version)


def _event_data(record: VersionRecord) -> dict[str, ConfigValue]:
    data: dict[str, ConfigValue] = {
        "round": record.round,
        "participants": record.participants,
        "samples": record.samples,
        "late_updates": record.late_updates,
    }
    for name in ("global_accuracy", "global_loss", "personal_accuracy", "train_loss"):
        value = float(getattr(record, name))
        if value == value:  # NaN (not evaluated) is left out
            data[name] = value
    return data
