"""Admitting a client: assignment, the member record, the Welcome (docs/architecture.md, step 2).

A re-Join of a live member gets the same assignment again, so joining is idempotent; a full job
answers `Error(job_full)`; a Join after the end gets the members' dismissal (docs/reliability.md,
**An ended job stays ended**). The record's `session` is the Join's, else a fresh one for a new
record, so a restarted client is a new incarnation (`membership.same_incarnation`) and the round
it was in stops waiting for the old process. Each session gets a `seq_base` (`seq_base_after`),
kept while the session is; how often a client is welcomed again: welcomes.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from functools import cached_property
from typing import Literal

from broker.errors import UnroutableError
from broker.messages import ConfigValue, Join, Welcome, new_message_id
from broker.store import JOB_FINISHED, WeightStore
from services.algorithms.base import StrategyBase, assign_level
from services.algorithms.registry import build_strategy
from services.common.handout import WeightsCache, client_config, dismissal
from services.common.jobmodel import job_model
from services.common.membership import MemberInfo, parse_classes, session_of
from services.common.outbox import Outbox
from services.common.schedule import COORDINATOR_STREAM, MemberEvent, ScheduleLog
from services.config.root import Settings
from services.coordinator.roster import Roster
from services.coordinator.welcomes import Verdict, WelcomeLimit

# How young the last read of all members may be for a Join to be refused as the job is full
# without another: expiries the index has not seen yet free slots (roster.py).
_FULL_SYNC_S = 1.0

# What became of a Join: "refused" (job full), "finished" (the job is over: told so instead of
# welcomed), "unreachable" (no reply queue: the join was undone), "withheld" (recorded, not
# welcomed again: its session's Welcome is on its way), "replayed" (to be dead-lettered),
# "too_soon" (to be answered after the interval: welcomes.py).
JoinOutcome = Literal[
    "new", "rejoined", "refused", "finished", "unreachable", "withheld", "replayed", "too_soon"
]


def seq_base_after(previous: int, now_us: int) -> int:
    """A new session's first seq: the wall clock in µs, and above `previous` (the base of the
    record it replaces; 0 if none).

    Strictly above every seq an earlier session of the client could have used, even one whose
    record expired long ago: a session starts at or below the clock of its Welcome and sends
    far fewer than one batch a µs, so its seqs stay below the clock. Above `previous` as well,
    should this coordinator's clock be behind the one that chose it. Above the earlier
    session's seqs matters: a worker takes a seq it has applied for a copy (workers/replica.py).
    """
    return max(now_us, previous + 1)


def choose_shard(
    shards: int,
    clients: int,
    partition: int,
    loads: Mapping[int, int],
    *,
    deterministic: bool = False,
) -> int:
    """The shard of a new member.

    With one shard per client (SFL-V1) shard k belongs to partition k, so a client's server
    model follows its data across re-joins. So it does in a deterministic job
    (`job.deterministic`): `partition % shards`, whatever order the clients joined in (an
    embedded run's client threads start in any order). Otherwise the least-loaded shard (by
    live members, ties to the lowest index) keeps every worker's queue equally busy.
    """
    if shards == clients or deterministic:
        return partition % shards
    return min(range(shards), key=lambda s: (loads.get(s, 0), s))


def open_round(version: int) -> int:
    """The round a membership event happens in: the one that trains the version after the
    current `version` (-1 before version 1)."""
    return version - 1 if version > 0 else -1


def requested_index(join: Join) -> int | None:
    """The partition index the client asks for (`info["index"]`), if it is an integer."""
    text = join.info.get("index", "").strip()
    try:
        return int(text) if text else None
    except ValueError:
        return None


def reported_classes(join: Join) -> tuple[int, ...] | None:
    """The classes of the client's training data (`info["classes"]`), None if absent or bad."""
    text = join.info.get("classes")
    if text is None:
        return None
    try:
        return parse_classes(text)
    except ValueError:
        return None


class LevelDesk:
    """A joining client's depth level and cut (FedSplitX), from the capability it declares: the
    rule is docs/algorithms.md, "FedSplitX and local-loss SFL", **Levels**. Jobs whose
    algorithm has one cut give every client the job's cut."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings

    @cached_property
    def _strategy(self) -> StrategyBase:
        algorithm = self._settings.algorithm
        return build_strategy(algorithm.name, algorithm.params())

    @cached_property
    def cuts(self) -> tuple[str, ...]:
        """The job's level cuts, shallow to deep (the model is built once)."""
        settings, server = self._settings, self._strategy.server
        if server is None:  # no split: the job's cut stands for the one level
            return (settings.model.cut,)
        return server.batch_cuts(job_model(settings), settings.model.cut)

    def cut(self, capability: int, partition: int) -> str:
        """The cut of the 1-based level of a client declaring `capability` with `partition`."""
        declared = capability or self._settings.clients.declared_capability(partition)
        server = self._strategy.server
        default = 1 if server is None else server.default_level
        level = assign_level(declared, len(self.cuts), default)
        return self.cuts[level - 1]


class JoinDesk:
    def __init__(
        self,
        settings: Settings,
        store: WeightStore,
        roster: Roster,
        outbox: Outbox,
        logger: logging.Logger,
        limit: WelcomeLimit,
        schedule: ScheduleLog | None = None,
    ) -> None:
        """`schedule`: where a new member's join is recorded (default: the coordinator's
        stream of the job's store)."""
        self._settings = settings
        self._store = store
        self._roster = roster
        self._outbox = outbox
        self._log = logger
        self._job = settings.job.name
        self._weights: WeightsCache | None = None
        self._levels = LevelDesk(settings)
        self.limit = limit
        self._schedule = schedule or ScheduleLog(store, self._job, COORDINATOR_STREAM)

    def join(self, message: Join) -> JoinOutcome:
        ended = self._store.job_status(self._job)
        if ended is not None:  # over already: no slot is taken (a full job is no reason here)
            return self._dismiss(message, self._store.current_version(self._job), ended.text)
        version = self._store.current_version(self._job)
        existing = self._roster.lookup(message.client)
        session = session_of(message.info)
        known = session or (existing.session if existing is not None else "")
        member = existing is not None
        verdict = self.limit.judge(message.client, message.message_id, known, member=member)
        if verdict is Verdict.REPLAYED:
            return "replayed"
        if verdict is Verdict.TOO_SOON:
            return "too_soon"
        if existing is not None:
            classes = reported_classes(message)
            same = known == existing.session and existing.seq_base > 0
            info = replace(
                existing,
                samples=message.samples,
                classes=existing.classes if classes is None else classes,
                session=known,
                # The session's base stays; a new process of the client starts above it.
                seq_base=existing.seq_base if same else self._seq_base(existing.seq_base),
            )
        else:
            assigned = self._assign(message, session or new_message_id())
            if assigned is None:
                live = len(self._roster.index)
                return "refused" if self._refuse(message, version, live) else "unreachable"
            info = assigned
        self._roster.record(info)
        # Read again after the member write: a Join racing the job's end is dismissed here or by
        # the aggregator. The version check covers a last version out with the end not recorded.
        ended = self._store.job_status(self._job)
        last = self._store.current_version(self._job)
        if ended is not None or last - 1 >= self._settings.job.rounds:
            self._roster.remove(message.client)
            return self._dismiss(message, last, ended.text if ended else JOB_FINISHED)
        if verdict is Verdict.WITHHOLD:
            return "withheld"
        welcome = self._welcome(message, info, version)
        try:
            with self.limit.sending(message.client, message.message_id, info.session):
                self._outbox.reply(message.client, welcome)
        except UnroutableError:
            if existing is None:
                self._roster.remove(message.client)
            return "unreachable"
        if existing is not None:
            restarted = " as a new process" if info.session != existing.session else ""
            self._log.info("job %s: client %s re-joined%s", self._job, message.client, restarted)
            return "rejoined"
        self._log.info(
            "job %s: client %s joined: shard %d, partition %d, %d samples",
            self._job,
            message.client,
            info.shard,
            info.partition,
            info.samples,
        )
        # Recorded (and written) now: who trains which partition on which shard, from when.
        self._schedule.add(
            MemberEvent("join", info.client, open_round(version), info.partition, info.shard)
        )
        self._schedule.flush()
        data = {"shard": info.shard, "partition": info.partition, "samples": info.samples}
        self._outbox.event("member_joined", version, data, message.client)
        return "new"

    def _assign(self, message: Join, session: str) -> MemberInfo | None:
        partition = self._partition(requested_index(message))
        if partition is None:
            return None
        count = self._settings.clients.count
        deterministic = self._settings.job.deterministic
        loads = self._roster.index.loads
        shard = choose_shard(
            self._settings.shards, count, partition, loads, deterministic=deterministic
        )
        return MemberInfo(
            client=message.client,
            shard=shard,
            cut=self._levels.cut(message.capability, partition),
            samples=message.samples,
            partition=partition,
            classes=reported_classes(message) or (),
            joined_at=time.time(),
            session=session,
            seq_base=self._seq_base(0),
        )

    @staticmethod
    def _seq_base(previous: int) -> int:
        return seq_base_after(previous, time.time_ns() // 1000)

    def _partition(self, requested: int | None) -> int | None:
        """`Partitions.choose` over the live members: the holders of a requested partition
        are read (one may have expired), and a full job is read whole before it refuses."""
        index = self._roster.index
        if requested is not None and requested in index.partitions:
            for holder in index.holders(requested):
                self._roster.lookup(holder)
        partition = self._roster.index.partitions.choose(requested)
        if partition is None and self._roster.sync_if_older(_FULL_SYNC_S):
            partition = self._roster.index.partitions.choose(requested)
        return partition

    def _dismiss(self, message: Join, version: int, status: str) -> JoinOutcome:
        """The job is over: the same `finished` assignment, with the job's `status`
        ("finished" or "failed: <reason>"), that the aggregator's dismissal sends."""
        try:
            self._outbox.reply(
                message.client, dismissal(self._settings, message.client, version, status)
            )
        except UnroutableError:
            return "unreachable"
        self._log.info(
            "job %s: client %s joined after the job ended (%s)", self._job, message.client, status
        )
        return "finished"

    def _refuse(self, message: Join, version: int, live: int) -> bool:
        """Tell the client the job is full; False when it has no reply queue to be told."""
        self._log.warning("job %s: refusing client %s: job full", self._job, message.client)
        count = self._settings.clients.count
        reason = f"job full: all {count} client slots are taken ({live} live)"
        return self._outbox.error(message.client, version, "job_full", reason, message.message_id)

    def _welcome(self, message: Join, info: MemberInfo, version: int) -> Welcome:
        if self._weights is None or self._weights.version != version:
            self._weights = WeightsCache(self._store, self._job, version)
        client_weights, aux_weights = self._weights.for_client(message.client)
        return Welcome(
            job=self._job,
            client=message.client,
            message_id=new_message_id(),
            version=version,
            shard=info.shard,
            cut=info.cut,
            # Version v closed rounds 0..v-2; the next one to open is v-1.
            round=max(0, version - 1),
            client_weights=client_weights,
            aux_weights=aux_weights,
            config={**client_config(self._settings, info.partition), **self._level_of(info.cut)},
            seq_base=info.seq_base,
        )

    def _level_of(self, cut: str) -> dict[str, ConfigValue]:
        """`{"level": m}` for a job with several depth levels (FedSplitX), else nothing."""
        cuts = self._levels.cuts
        return {"level": cuts.index(cut) + 1} if len(cuts) > 1 and cut in cuts else {}
