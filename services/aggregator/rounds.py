"""The sync clock: rounds with a cohort, a deadline and a quorum (docs/architecture.md, "Sync
round protocol", steps 3, 5 and 6). A reopened round publishes nothing; a closed round's version
waits for every cohort shard's replica, however late (docs/reliability.md, "A late replica"):
a worker reloads its replica from each new version, so a version published without it would
lose every batch the shard applied in the round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from broker.messages import ConfigValue, Message, RoundEnd, RoundStart, new_message_id
from broker.store import Checkpoint, MemberKind, MemberStore
from services.aggregator.core import Core, read_version
from services.aggregator.gate import reference_of
from services.aggregator.round_gate import (
    ClosedGate,
    Decision,
    EmptyAttempt,
    EmptyStreak,
    OpenRound,
    sample_cohort,
)
from services.algorithms.base import ShardReplica
from services.common.handout import WeightsCache
from services.common.leases import worker_beat
from services.common.logs import log_context
from services.common.membership import MemberInfo
from services.common.schedule import FoldedUpdate
from services.common.server_fold import meta_cuts, meta_int
from services.common.supervise import JobFailedError

# How often the store is read for the shards' replicas after RoundEnd.
_POLL_S = 0.05


def replica_of(checkpoint: Checkpoint) -> ShardReplica:
    """A shard's replica as its checkpoint hands it in, weighted by its `round_samples`."""
    meta = checkpoint.meta
    cuts = {c: n for c, n in meta_cuts(meta).items() if n > 0}
    samples = max(0, meta_int(meta, "round_samples", 0))
    return ShardReplica(checkpoint.shard, samples, dict(checkpoint.weights), cuts)


def shard_holders(store: MemberStore, job: str) -> dict[int, str]:
    """Shard → the live worker whose heartbeat says it holds the shard's lease."""
    holders: dict[int, str] = {}
    for member in store.live_members(job, MemberKind.WORKER).values():
        beat = worker_beat(member)
        if beat is not None:
            holders.update(dict.fromkeys(beat.shards, beat.worker))
    return holders


def cohort_shards(cohort: Mapping[str, MemberInfo]) -> dict[int, dict[str, ConfigValue]]:
    """Shard → {client: samples} of the cohort members it serves."""
    by_shard: dict[int, dict[str, ConfigValue]] = {}
    for client, info in sorted(cohort.items()):
        by_shard.setdefault(info.shard, {})[client] = info.samples
    return dict(sorted(by_shard.items()))


@dataclass
class RoundClock(Core):
    # Live members reported as not ready (no training samples): logged once each while so.
    _unready: set[str] = field(default_factory=set, init=False)
    # Whether this clock opened a round yet: its first waits for `clients.min_to_start`.
    _opened: bool = field(default=False, init=False)
    # A replay's cohorts by round index (`splitmq replay`: the run's, from its record) in
    # place of the seeded draw; empty in a run of its own.
    cohorts: Mapping[int, Sequence[str]] = field(default_factory=dict)

    def start(self, version: int) -> None:
        pass  # the store's current version says which round comes next

    def step(self, version: int) -> int:
        """Train `version` into the next (unless stopped, or another aggregator publishes it
        first); the store's current version after."""
        r = version - 1
        self.mark()
        earlier: frozenset[str] = frozenset()
        attempt = 0
        streak = EmptyStreak(self.settings.rounds.max_empty_attempts)
        with log_context(version=version, round=r + 1):  # rounds read from 1
            while not self.stop.is_set():
                state = self._open(version, attempt, earlier)
                if state is None:
                    break
                decision = self._collect(state)
                if decision is not None:  # the attempt's accepted RoundDropped, for the record
                    for client in sorted(state.declined):
                        self.dropped_round(client, state.round)
                if decision is Decision.CLOSE:
                    self._close(state)
                if decision is not Decision.REOPEN:
                    break
                empty = EmptyAttempt.of(state, self.inbox.refusals)
                if streak.add(empty):
                    raise JobFailedError(streak.failure(r, empty))
                self.stats.reopened += 1
                self.log.warning(
                    "job %s: round %d got no valid update (%s; %d of %s empty attempts in a row); "
                    "reopening it",
                    self.job,
                    r + 1,
                    empty.reasons(),
                    streak.count,
                    streak.limit or "unlimited",
                )
                earlier = earlier | frozenset(state.cohort)
                attempt += 1
        return self.store.current_version(self.job)

    def _await_members(self, r: int, version: int) -> dict[str, MemberInfo] | None:
        clients = self.settings.clients
        # Round 0, and the round a resumed (or restarted) job goes on with: its clients are
        # joining now, and the first to join must not make the round alone.
        need = clients.min_to_start if r == 0 or not self._opened else 1
        since = self.clock()
        # Before round r opens, its updates can only come from an earlier attempt at it (this
        # run's, or a predecessor's): late, not malformed.
        gate = ClosedGate(r)
        ready = self._ready(self.members.live())  # the round's one read of all the members
        while not self.stop.is_set():
            timed_out = self.clock() - since >= clients.start_timeout_s
            if len(ready) >= need or (ready and timed_out):
                return ready
            # Polling the updates queue doubles as the wait, and answers late updates meanwhile.
            self.inbox.poll(self.poll_s, gate, version)
            if (live := self.members.recent()) is not None:
                ready = self._ready(live)
        return None

    def _ready(self, live: dict[str, MemberInfo]) -> dict[str, MemberInfo]:
        """The members a round can count on: those with training samples (`MemberInfo.ready`).
        The others wait out of the cohorts (and are dismissed with the rest at the end)."""
        ready = {c: m for c, m in live.items() if m.ready}
        unready = live.keys() - ready.keys()
        for client in sorted(unready - self._unready):
            self.log.info(
                "job %s: client %s (partition %d) has no training samples (yet): it is left "
                "out of the cohorts until it reports some",
                self.job,
                client,
                live[client].partition,
            )
        self._unready = unready
        return ready

    def _open(self, version: int, attempt: int, earlier: frozenset[str]) -> OpenRound | None:
        r = version - 1
        live = self._await_members(r, version)
        if live is None:
            return None
        settings = self.settings
        size = settings.clients.cohort_size(len(live))
        if r in self.cohorts:
            chosen = [c for c in self.cohorts[r] if c in live]
        else:
            chosen = sample_cohort(
                live, size, seed=settings.job.seed, round_index=r, attempt=attempt
            )
        cohort = {c: live[c] for c in chosen}
        weights = WeightsCache(self.store, self.job, version)
        global_client, global_aux = weights.global_weights()
        starts = {
            s: RoundStart(self.job, "", new_message_id(), version, r, s, participants)
            for s, participants in cohort_shards(cohort).items()
        }
        if self.strategy.server is not None and not self._to_shards(starts):
            return None
        # Refusals count per attempt: the ones before it belong to an earlier one.
        self.inbox.refusals.clear()
        state = OpenRound(
            round=r,
            version=version,
            cohort=cohort,
            opened_at=self.clock(),
            deadline_s=settings.rounds.deadline_s,
            quorum=settings.rounds.quorum,
            client_ref=reference_of(global_client),
            aux_ref=reference_of(global_aux),
            earlier=earlier,
        )
        for client, info in cohort.items():
            message_id = self.assign(weights, client, info.partition, r)
            if message_id:
                state.assigned[client] = message_id
            else:  # no reply queue: not waited for
                state.dropped.add(client)
        self._opened = True
        self.log.info(
            "job %s: round %d opened (version %d, cohort %s)",
            self.job,
            r + 1,
            version,
            sorted(cohort),
        )
        self.outbox.event(
            "round_opened", version, {"round": r + 1, "cohort": len(cohort), "attempt": attempt}
        )
        return state

    def _to_shards(self, markers: Mapping[int, Message]) -> bool:
        """Each shard its round marker (waiting out back-pressure); False if stopped first."""
        return all(self.outbox.to_shard(s, m, self.stop) for s, m in markers.items())

    def _collect(self, state: OpenRound) -> Decision | None:
        """Take updates until the round closes or must reopen; None when stopped."""
        while not self.stop.is_set():
            self.inbox.poll(self.poll_s, state, state.version)
            live = self.members.recent()
            if live is not None:
                for client in state.drop(live):
                    self.log.info(
                        "job %s: round %d stops waiting for %s (%s)",
                        self.job,
                        state.round + 1,
                        client,
                        "rejoined as a new process" if client in live else "left or expired",
                    )
            if state.decide(self.clock()) is not Decision.WAIT:
                # Updates already queued at the deadline still count.
                self.inbox.drain(state, state.version)
                return state.decide(self.clock())
        return None

    def _close(self, state: OpenRound) -> None:
        round_s = self.clock() - state.opened_at
        handed_in = self._replicas(state)
        if handed_in is None:
            return
        replicas = [replica for replica, _ in handed_in]
        updates = [state.updates[c] for c in sorted(state.updates)]
        current = read_version(self.store, self.job, state.version)
        blobs = self.strategy.aggregate(current, updates, replicas)
        folded = [
            FoldedUpdate(
                u.client,
                u.base_version,
                state.version - u.base_version,
                1.0,
                float(u.trained_samples),
            )
            for u in updates
        ]
        applied = [(replica.shard, n) for replica, n in handed_in]
        version = self.commit(
            state.version,
            blobs,
            updates,
            replicas,
            {},
            folded=folded,
            applied=applied,
            cohort=sorted(state.cohort),
        )
        if version is not None:
            classes = {c: info.classes for c, info in state.cohort.items()}
            self.record(version, blobs, updates, classes, round_s=round_s, replicas=len(replicas))

    def _replicas(self, state: OpenRound) -> list[tuple[ShardReplica, int]] | None:
        """RoundEnd behind the round's batches, then the replicas the shards' workers hand in
        for the round, in shard order, however long they take, each with its checkpoint's
        applied count; None if stopped first."""
        if self.strategy.server is None:
            return []
        pending = list(cohort_shards(state.cohort))
        ends = {
            s: RoundEnd(self.job, "", new_message_id(), state.version, state.round, s)
            for s in pending
        }
        since = self.clock()  # counted from before RoundEnd goes out, which may wait its turn
        if not self._to_shards(ends):
            return None
        found: dict[int, tuple[ShardReplica, int]] = {}
        every_s = self.settings.rounds.replica_timeout_s
        report_at = since + every_s
        while pending:
            for shard in list(pending):
                checkpoint = self.store.load_checkpoint(self.job, shard)
                if checkpoint is not None and meta_int(checkpoint.meta, "round", -1) >= state.round:
                    found[shard] = (replica_of(checkpoint), checkpoint.applied)
                    pending.remove(shard)
            if not pending:
                break
            if self.clock() >= report_at:
                if report_at == since + every_s:  # the first report of this round
                    self.stats.late_replicas += 1
                self._still_waiting(state, pending, self.clock() - since)
                report_at = self.clock() + every_s
            if self.stop.wait(_POLL_S):
                return None
        return [found[s] for s in sorted(found)]

    def _still_waiting(self, state: OpenRound, pending: list[int], waited_s: float) -> None:
        """Say, each `replica_timeout_s`, which replicas the version waits for and whether a
        worker serves their shards (a backlog ahead of RoundEnd), or none does (it died: the
        worker that takes the shard over restores its checkpoint, is redelivered what the
        checkpoint lacks, and hands the round in)."""
        holders = shard_holders(self.store, self.job)
        for shard in pending:
            worker = holders.get(shard)
            served = (
                f"worker {worker} holds it (still working through the shard's queue)"
                if worker
                else "no live worker holds it: the one that takes it over hands it in; start "
                "one (`splitmq worker`) if none is left"
            )
            self.log.warning(
                "job %s: no replica of shard %d for round %d after %.0f s; %s. Version %d "
                "waits for it: publishing without it would lose the batches it applied",
                self.job,
                shard,
                state.round + 1,
                waited_s,
                served,
                state.version + 1,
            )
