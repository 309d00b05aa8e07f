"""Which WeightsUpdates the asynchronous aggregator buffers (async mode's `Gate`).

There are no rounds: an update from a member (screened by the inbox: the model's tensor
names and shapes), based on a version at most `max_staleness` behind the current one, is
buffered with what it started from and what it would start from now
(`services.algorithms.async_fold`). A staler one is valid but refused: acked, counted and
answered with `Error("too_stale")`.
Every member whose update was judged (buffered or too stale) is owed the newest weights,
which the driver sends once it has folded what is due (`owed`).

A member's `RoundDropped` notice is taken and counted, nothing more (the client asks for new
weights itself). Notices and members' unusable updates since the last buffered update are
`fruitless`, by reason: the driver fails the job when they pile up (a diverged job would
otherwise retrain and drop for ever).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from broker.errors import VersionNotFoundError
from broker.messages import RoundDropped, WeightsUpdate
from broker.store import WeightStore
from services.aggregator.gate import Offer, Reference, Verdict, reference_of
from services.algorithms.async_fold import StaleUpdate
from services.algorithms.base import ClientUpdate
from services.algorithms.staleness import TOO_STALE, StalenessRule
from services.common.handout import WeightsCache
from services.common.membership import MemberInfo

Tensors = dict[str, torch.Tensor]
# Message ids of updates already buffered or folded, remembered to spot redeliveries.
_SEEN_LIMIT = 10_000


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


def _copy(state: Mapping[str, torch.Tensor], reference: Reference) -> Tensors:
    """Copies in the version's dtypes (decoded tensors are views of the message body)."""
    return {n: t.to(dtype=reference[n].dtype, copy=True) for n, t in state.items()}


@dataclass
class AsyncGate:
    store: WeightStore
    job: str
    rule: StalenessRule
    # Live member by id, or None (the driver re-reads the store for an unknown id).
    member: Callable[[str], MemberInfo | None]
    version: int = 0
    buffer: list[Buffered] = field(default_factory=list)
    owed: list[Owed] = field(default_factory=list)
    too_stale: int = 0  # refused since the last fold
    # Members' local rounds that came to nothing since the last buffered update, by reason.
    fruitless: Counter[str] = field(default_factory=Counter)
    _seen: OrderedDict[str, None] = field(default_factory=OrderedDict)
    _weights: dict[int, WeightsCache] = field(default_factory=dict)
    _client_ref: Reference = field(default_factory=dict)
    _aux_ref: Reference = field(default_factory=dict)

    def at(self, version: int) -> None:
        """The current version is `version` now: staleness counts from it."""
        self.version = version
        client, aux = self._cache(version).global_weights()
        self._client_ref, self._aux_ref = reference_of(client), reference_of(aux)
        oldest = version - self.rule.max_staleness
        for old in [v for v in self._weights if v < oldest]:
            del self._weights[old]

    def remember(self, message_ids: list[str]) -> None:
        """Updates already folded (by this aggregator or a predecessor): never again."""
        for message_id in message_ids:
            self._seen[message_id] = None
        while len(self._seen) > _SEEN_LIMIT:
            self._seen.popitem(last=False)

    def take(self) -> list[Buffered]:
        taken, self.buffer = self.buffer, []
        return taken

    def offer(self, update: WeightsUpdate) -> Offer:
        if update.message_id in self._seen:
            return Offer(Verdict.DUPLICATE)
        if update.version > self.version:
            return Offer(
                Verdict.REJECT,
                f"update based on version {update.version}, beyond the current {self.version}",
            )
        info = self.member(update.client)
        if info is None:  # the screen refuses strangers; this one's record is unreadable now
            return Offer(Verdict.REJECT, f"client {update.client!r} is not a member of the job")
        tau = self.version - update.version
        if not self.rule.accepts(tau):
            return self._refuse(
                update, info, f"{tau} versions behind, max {self.rule.max_staleness}"
            )
        try:
            base_client, base_aux = self._cache(update.version).for_client(update.client)
        except VersionNotFoundError:
            return self._refuse(update, info, f"base version {update.version} is no longer kept")
        current_client, current_aux = self._cache(self.version).for_client(update.client)
        stale = StaleUpdate(
            update=ClientUpdate(
                client=update.client,
                samples=update.samples,
                base_version=update.version,
                client_weights=_copy(update.client_weights, self._client_ref),
                aux_weights=_copy(update.aux_weights, self._aux_ref),
                masks={n: m.clone() for n, m in update.masks.items()},
                metrics=dict(update.metrics),
            ),
            tau=tau,
            base_client=base_client,
            base_aux=base_aux,
            current_client=current_client,
            current_aux=current_aux,
        )
        self.buffer.append(Buffered(stale, update.message_id, info))
        self.fruitless.clear()
        self.remember([update.message_id])
        self.owed.append(Owed(update.client, info.partition, update.round + 1))
        return Offer(Verdict.ACCEPT)

    def offer_drop(self, drop: RoundDropped) -> Offer:
        """A member's notice that a local round came to nothing: acked and counted."""
        if drop.message_id in self._seen:
            return Offer(Verdict.DUPLICATE)
        if self.member(drop.client) is None:
            reason = f"client {drop.client!r} is not a member of the job"
            return Offer(Verdict.REJECT, reason, kind="not_member")
        self.remember([drop.message_id])
        self.fruitless[drop.reason] += 1
        return Offer(Verdict.ACCEPT, kind=drop.reason)

    def refused(self, client: str) -> None:
        """A member's unusable update: its local round came to nothing."""
        self.fruitless["refused"] += 1

    def _refuse(self, update: WeightsUpdate, info: MemberInfo, why: str) -> Offer:
        self.too_stale += 1
        self.remember([update.message_id])
        self.owed.append(Owed(update.client, info.partition, update.round + 1))
        reason = f"{TOO_STALE}: update based on version {update.version}: {why}"
        return Offer(Verdict.LATE, reason, code=TOO_STALE)

    def _cache(self, version: int) -> WeightsCache:
        cache = self._weights.get(version)
        if cache is None:
            cache = WeightsCache(self.store, self.job, version)
            self._weights[version] = cache
        return cache
