"""What the inbox asks of every update and drop notice, in both modes: the screen, then a gate.

The screen (`UpdateScreen`) checks what holds for every version of the job: the sender is a
member (`MemberBook`), and an update reports samples and has the model's tensor names, shapes
and kinds (`has_samples`, `TensorsFit`: delivery checks, services/common/checks). A message
that fails it is dead-lettered with its reason even when its round is long closed. Round,
version, cohort and staleness are the gate's business (`round_gate.OpenRound` and
`round_gate.ClosedGate` in sync mode, `buffered.BufferClock` in async mode).

Every read of the members goes through one `MemberBook`, so a client the clock put in a cohort
is known to the screen by construction. A member that left stays known for a while (an update
it sent just before is judged as anyone's); a stranger triggers a re-read, but only so many a
second, so a flood of made-up ids is not a store read per message.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from broker.messages import RoundDropped, WeightsUpdate
from broker.rejection import Rejection
from broker.store import WeightStore
from broker.transport import Delivery
from services.aggregator.budget import STRANGERS, SenderBudgets
from services.algorithms.base import ClientUpdate
from services.common.checks.chain import Check
from services.common.handout import WeightsCache
from services.common.membership import MemberInfo, client_members


class Verdict(enum.Enum):
    ACCEPT = "accept"
    DUPLICATE = "duplicate"  # a second update of one client for one round: ignored
    LATE = "late"  # valid but its round has closed: answered with round_closed
    REJECT = "reject"  # dead-lettered with the reason


@dataclass(frozen=True)
class Offer:
    verdict: Verdict
    reason: str = ""
    # The Error code a LATE update is answered with (async mode: "too_stale").
    code: str = "round_closed"
    # What kind of refusal a REJECT is, counted per round attempt (`round_gate.EmptyAttempt`).
    kind: str = "rejected"


# Refusal kind of a message whose sender is no member (the only one that is not a member's).
NOT_MEMBER = "not_member"


class Gate(Protocol):
    def offer(self, update: WeightsUpdate) -> Offer: ...

    def offer_drop(self, drop: RoundDropped) -> Offer: ...

    def refused(self, client: str) -> None:
        """A member's update the screen refused (dead-lettered already)."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype


Reference = Mapping[str, TensorSpec]


def reference_of(state: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {name: TensorSpec(tuple(t.shape), t.dtype) for name, t in state.items()}


def client_update(update: WeightsUpdate, client_ref: Reference, aux_ref: Reference) -> ClientUpdate:
    """What a gate keeps of an update it takes: copies in the version's dtypes (a client may
    send float16; the decoded tensors are views of the message body)."""

    def copy(state: Mapping[str, torch.Tensor], ref: Reference) -> dict[str, torch.Tensor]:
        return {n: t.to(dtype=ref[n].dtype, copy=True) for n, t in state.items()}

    return ClientUpdate(
        client=update.client,
        samples=update.samples,
        base_version=update.version,
        client_weights=copy(update.client_weights, client_ref),
        aux_weights=copy(update.aux_weights, aux_ref),
        masks={n: m.clone() for n, m in update.masks.items()},
        metrics=dict(update.metrics),
    )


def weights_problem(
    weights: Mapping[str, torch.Tensor], reference: Reference, what: str, *, subset: bool
) -> str | None:
    """Why `weights` do not fit `reference` (None when they do). `subset` allows missing names
    (aux heads: a client holds only the heads it trains)."""
    unknown = sorted(set(weights) - set(reference))
    missing = [] if subset else sorted(set(reference) - set(weights))
    if unknown or missing:
        return f"{what}: unknown tensors {unknown[:3]}, missing tensors {missing[:3]}"
    for name, tensor in weights.items():
        spec = reference[name]
        if tuple(tensor.shape) != spec.shape:
            return f"{what}.{name}: shape {list(tensor.shape)}, expected {list(spec.shape)}"
        if tensor.is_floating_point() != spec.dtype.is_floating_point:
            return f"{what}.{name}: dtype {tensor.dtype}, expected {spec.dtype}"
    return None


def masks_problem(
    masks: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]
) -> str | None:
    """Why `masks` (Sub-FedAvg) do not fit the update's own `weights`: each must mask one of
    them, with its shape."""
    for name, mask in masks.items():
        tensor = weights.get(name)
        if tensor is None:
            return f"masks.{name}: no such tensor in client_weights"
        if mask.shape != tensor.shape:
            return f"masks.{name}: shape {list(mask.shape)}, the weights have {list(tensor.shape)}"
    return None


# Re-reads of the members on a stranger: a burst of this many, then this many a second.
_STRANGER_READS = 20


@dataclass
class MemberBook:
    """The aggregator's view of the members: one read of them all (O(members) in the store and
    here) at each round's opening, and while the clocks take updates at most once per
    `refresh_s` (the heartbeat interval: liveness changes no faster than a member beats), never
    once per poll. A member that left stays known for `keep_s` after the read that missed it,
    then is forgotten, so what the book holds is bounded by the live members and the recent
    departures, not by every member ever seen."""

    store: WeightStore
    job: str
    clock: Callable[[], float] = time.monotonic
    refresh_s: float = 1.0
    keep_s: float = 240.0
    # The live client members at the last read.
    live_now: dict[str, MemberInfo] = field(default_factory=dict)
    # Members gone at a read since `keep_s`: their last record and when they were missed.
    departed: dict[str, tuple[MemberInfo, float]] = field(default_factory=dict)
    reads: int = 0  # reads of the members from the store

    def __post_init__(self) -> None:
        self._rereads = SenderBudgets(_STRANGER_READS, _STRANGER_READS, self.clock)
        self._read_at = float("-inf")

    def live(self) -> dict[str, MemberInfo]:
        """The live client members, read from the store now (and remembered)."""
        live = client_members(self.store, self.job)
        now = self.clock()
        self.reads += 1
        for client in self.live_now.keys() - live.keys():
            self.departed[client] = (self.live_now[client], now)
        for client in self.departed.keys() & live.keys():
            del self.departed[client]
        for client in [c for c, (_, at) in self.departed.items() if now - at >= self.keep_s]:
            del self.departed[client]
        self.live_now = live
        self._read_at = now
        return live

    def recent(self) -> dict[str, MemberInfo] | None:
        """The live members if the last read is `refresh_s` old (read again now), else None."""
        return self.live() if self.clock() - self._read_at >= self.refresh_s else None

    def knows(self, client: str) -> bool:
        """Whether `client` is a member, or left within `keep_s` (`get`)."""
        return self.get(client) is not None

    def get(self, client: str) -> MemberInfo | None:
        """`client`'s record if it is a member, or left within `keep_s`, else None."""
        info = self.live_now.get(client)
        if info is None and client in self.departed:
            info = self.departed[client][0]
        if info is None and self._rereads.spend(STRANGERS):
            info = self.live().get(client)
        return info


def has_samples(delivery: Delivery, update: WeightsUpdate, /) -> Rejection | None:
    """An update must report what it trained on: its samples weigh it in the round."""
    if update.samples >= 1:
        return None
    return Rejection("no_samples", "an update must report at least one training sample")


@dataclass(frozen=True)
class TensorsFit:
    """An update's masks fit its own weights, and its weights the job's model."""

    client_ref: Reference
    aux_ref: Reference
    # A client may upload part of the client blob (FedSplitX: the blocks up to its level).
    partial_clients: bool = False

    def __call__(self, delivery: Delivery, update: WeightsUpdate, /) -> Rejection | None:
        bad = (
            masks_problem(update.masks, update.client_weights)
            or weights_problem(
                update.client_weights,
                self.client_ref,
                "client_weights",
                subset=self.partial_clients,
            )
            or weights_problem(update.aux_weights, self.aux_ref, "aux_weights", subset=True)
        )
        return None if bad is None else Rejection("wrong_tensors", bad)


@dataclass(frozen=True)
class UpdateScreen:
    """The members, and the checks of a member's update (after those of its sender, which the
    inbox runs first; a drop notice has none of its own)."""

    members: MemberBook
    checks: tuple[Check[WeightsUpdate], ...]

    @classmethod
    def of(
        cls, store: WeightStore, job: str, version: int, members: MemberBook, *, partial: bool
    ) -> UpdateScreen:
        """The screen of a job whose model is that of `version` (any published one)."""
        client, aux = WeightsCache(store, job, version).global_weights()
        fit = TensorsFit(reference_of(client), reference_of(aux), partial)
        return cls(members, (has_samples, fit))
