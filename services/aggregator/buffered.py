"""The asynchronous (FedBuff-style) clock: no rounds, only versions. What it does with each
update and notice, when it folds, and how a successor avoids folding one twice (the manifest's
folded message ids): docs/async.md, "The protocol".
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from broker.errors import VersionNotFoundError
from broker.messages import RoundDropped, WeightsUpdate
from broker.store import SERVER_PART, BlobRef
from services.aggregator.core import Core, read_version
from services.aggregator.gate import Offer, Reference, Verdict, client_update, reference_of
from services.algorithms.async_fold import StaleUpdate, fold
from services.algorithms.base import ShardReplica
from services.algorithms.staleness import TOO_STALE, StalenessRule
from services.common.handout import WeightsCache
from services.common.membership import MemberInfo
from services.common.schedule import FoldedUpdate
from services.common.server_fold import FoldedCheckpoint, ServerLedger
from services.common.supervise import JobFailedError
from services.report.summary import STALENESS_PREFIX

# Message ids of updates already buffered or folded, remembered to spot redeliveries.
_SEEN_LIMIT = 10_000
# Manifest meta key: the message ids of the updates a version folded.
FOLDED_IDS = "message_ids"


def staleness_extra(taus: Sequence[int], refused: int, buffer_size: int) -> dict[str, float]:
    """A version's staleness columns: the histogram of its folded updates (`staleness.<tau>`)
    and the refusals."""
    counts = Counter(taus)
    extra = {f"{STALENESS_PREFIX}{tau}": float(n) for tau, n in sorted(counts.items())}
    extra["staleness_mean"] = sum(taus) / len(taus) if taus else 0.0
    extra["staleness_max"] = float(max(taus, default=0))
    extra["too_stale"] = float(refused)
    extra["buffer_size"] = float(buffer_size)
    return extra


@dataclass(frozen=True)
class Buffered:
    stale: StaleUpdate
    message_id: str
    info: MemberInfo


@dataclass(frozen=True)
class Owed:
    """A member that uploaded and is owed the newest weights, to train its next local round."""

    client: str
    partition: int
    next_round: int


class BufferClock(Core):
    """The async clock, and its gate: the inbox offers it every screened update and notice."""

    def __post_init__(self) -> None:
        super().__post_init__()
        settings, a = self.settings, self.settings.asynchronous
        self._k = settings.buffer_size
        self._fruitless_limit = a.max_fruitless_per_client * settings.clients.count
        self._rule = StalenessRule(a.staleness, a.a, a.b, a.max_staleness)
        self._server = ServerLedger(self.store, self.job, settings.shards, self.log)
        self._version_at = self.clock()
        self.version = 0  # staleness counts from it
        self.buffer: list[Buffered] = []
        self.owed: list[Owed] = []
        self.too_stale = 0  # refused since the last fold
        # Members' local rounds that came to nothing since the last buffered update, by reason.
        self.fruitless: Counter[str] = Counter()
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._weights: dict[int, WeightsCache] = {}
        self._client_ref: Reference = {}
        self._aux_ref: Reference = {}

    def start(self, version: int) -> None:
        """Start at `version`: what recent versions folded is never folded again."""
        self._at(version)
        oldest = version - self._rule.max_staleness - 2
        for v in [v for v in self.store.versions(self.job) if v > oldest]:
            try:
                meta = self.store.manifest(self.job, v).meta
            except VersionNotFoundError:
                continue
            self._remember([m for m in meta.get(FOLDED_IDS, "").split(",") if m])
            if v == version:
                self._server.restore(meta)
        self.log.info(
            "job %s: asynchronous at version %d (K=%d, %s staleness, max %d)",
            self.job,
            version,
            self._k,
            self._rule.kind,
            self._rule.max_staleness,
        )

    def step(self, version: int) -> int:
        """One poll of the inbox; a fold when K updates are buffered; the newest weights to
        the members owed them."""
        self.inbox.poll(self.poll_s, self, version)
        self._check_progress()
        if len(self.buffer) >= self._k:
            self._fold(version)
            version = self.store.current_version(self.job)
            self._at(version)
        if version - 1 < self.settings.job.rounds:  # after the last, members are dismissed
            self._answer(version)
        return version

    def abandon(self) -> int:
        self.owed.clear()
        dropped, self.buffer = len(self.buffer), []
        return dropped

    def offer(self, update: WeightsUpdate) -> Offer:
        if update.message_id in self._seen:
            return Offer(Verdict.DUPLICATE)
        if update.version > self.version:
            return Offer(
                Verdict.REJECT,
                f"update based on version {update.version}, beyond the current {self.version}",
            )
        info = self._member(update.client)
        if info is None:  # the screen refuses strangers; this one's record is unreadable now
            return Offer(Verdict.REJECT, f"client {update.client!r} is not a member of the job")
        tau = self.version - update.version
        if not self._rule.accepts(tau):
            return self._refuse(
                update, info, f"{tau} versions behind, max {self._rule.max_staleness}"
            )
        try:
            base_client, base_aux = self._cache(update.version).for_client(update.client)
        except VersionNotFoundError:
            return self._refuse(update, info, f"base version {update.version} is no longer kept")
        current_client, current_aux = self._cache(self.version).for_client(update.client)
        taken = client_update(update, self._client_ref, self._aux_ref)
        stale = StaleUpdate(taken, tau, base_client, base_aux, current_client, current_aux)
        self.buffer.append(Buffered(stale, update.message_id, info))
        self.fruitless.clear()
        self._remember([update.message_id])
        self.owed.append(Owed(update.client, info.partition, update.round + 1))
        return Offer(Verdict.ACCEPT)

    def offer_drop(self, drop: RoundDropped) -> Offer:
        """A member's notice that a local round came to nothing: acked and counted."""
        if drop.message_id in self._seen:
            return Offer(Verdict.DUPLICATE)
        if drop.version > self.version:  # junk: enough notices in a row would fail the job
            reason = (
                f"RoundDropped based on version {drop.version}, beyond the current {self.version}"
            )
            return Offer(Verdict.REJECT, reason, kind="wrong_version")
        if self._member(drop.client) is None:
            reason = f"client {drop.client!r} is not a member of the job"
            return Offer(Verdict.REJECT, reason, kind="not_member")
        self._remember([drop.message_id])
        self.fruitless[drop.reason] += 1
        self.dropped_round(drop.client, drop.round)
        return Offer(Verdict.ACCEPT, kind=drop.reason)

    def refused(self, client: str) -> None:
        """A member's unusable update: its local round came to nothing."""
        self.fruitless["refused"] += 1

    def _refuse(self, update: WeightsUpdate, info: MemberInfo, why: str) -> Offer:
        self.too_stale += 1
        self._remember([update.message_id])
        self.owed.append(Owed(update.client, info.partition, update.round + 1))
        reason = f"{TOO_STALE}: update based on version {update.version}: {why}"
        return Offer(Verdict.LATE, reason, code=TOO_STALE)

    def _at(self, version: int) -> None:
        self.version = version
        client, aux = self._cache(version).global_weights()
        self._client_ref, self._aux_ref = reference_of(client), reference_of(aux)
        oldest = version - self._rule.max_staleness
        for old in [v for v in self._weights if v < oldest]:
            del self._weights[old]

    def _remember(self, message_ids: list[str]) -> None:
        """Updates already buffered or folded (by this aggregator or a predecessor): never
        again."""
        for message_id in message_ids:
            self._seen[message_id] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def _cache(self, version: int) -> WeightsCache:
        return self._weights.setdefault(version, WeightsCache(self.store, self.job, version))

    def _member(self, client: str) -> MemberInfo | None:
        # Fresh records now and then; a member that left keeps its record (`gate.MemberBook`).
        self.members.recent()
        return self.members.get(client)

    def _fold(self, version: int) -> None:
        buffered, self.buffer = self.buffer, []
        refused, self.too_stale = self.too_stale, 0
        current = read_version(self.store, self.job, version)
        replicas: list[ShardReplica] = []
        taken: dict[int, FoldedCheckpoint] = {}
        if self.strategy.server is not None and BlobRef(SERVER_PART) in current:
            replicas, taken = self._server.fresh(current[BlobRef(SERVER_PART)])
        blobs = fold(self.strategy, current, [b.stale for b in buffered], self._rule, replicas)
        updates = [b.stale.update for b in buffered]
        taus = [b.stale.tau for b in buffered]
        meta = {
            "mode": "async",
            "staleness": ",".join(str(tau) for tau in taus),
            FOLDED_IDS: ",".join(b.message_id for b in buffered),
            **self._server.meta(taken),
        }
        folded = [
            FoldedUpdate(
                u.client, u.base_version, tau, self._rule.weight(tau), float(u.trained_samples)
            )
            for u, tau in zip(updates, taus, strict=True)
        ]
        applied = [(shard, checkpoint.applied) for shard, checkpoint in sorted(taken.items())]
        published = self.commit(
            version, blobs, updates, replicas, meta, folded=folded, applied=applied
        )
        if published is None:
            return
        self._server.commit(taken)
        # The clients owed weights train on while this version is evaluated (after the last
        # version they are dismissed instead).
        if published - 1 < self.settings.job.rounds:
            self._answer(published)
        self.stats.folded += len(buffered)
        self.stats.too_stale += refused
        now = self.clock()
        round_s, self._version_at = now - self._version_at, now
        extra = {**staleness_extra(taus, refused, self._k), "replicas": float(len(replicas))}
        classes = {b.info.client: b.info.classes for b in buffered}
        self.record(
            published, blobs, updates, classes, round_s=round_s, replicas=len(replicas), extra=extra
        )

    def _answer(self, version: int) -> None:
        """The newest weights to every member whose update was judged since the last call."""
        if not self.owed:
            return
        owed, self.owed = self.owed, []
        weights = WeightsCache(self.store, self.job, version)
        for o in owed:
            self.assign(weights, o.client, o.partition, o.next_round)

    def _check_progress(self) -> None:
        """Fail the job when too many local rounds in a row came to nothing: every client
        diverging, say, would retrain and drop for ever."""
        fruitless = self.fruitless
        count = sum(fruitless.values())
        if not self._fruitless_limit or count < self._fruitless_limit:
            return
        reasons = ", ".join(f"{kind} ×{n}" for kind, n in sorted(fruitless.items()))
        raise JobFailedError(
            f"{count} local rounds in a row came to nothing, with no update buffered in "
            f"between; reasons: {reasons}"
        )
