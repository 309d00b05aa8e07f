"""What a valid message on a shard queue looks like: the worker's own checks of the delivery
chain (services/common/checks), each unit-tested alone.

A check returns a `Rejection` for a message to dead-letter (its code: the counter key and the
reason's head), else None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch

from broker.messages import RoundStart, SmashedBatch
from broker.rejection import Rejection
from broker.transport import Delivery
from models.split import Shape


@dataclass(frozen=True)
class ShardExpectations:
    """What a valid message on one shard queue looks like."""

    job: str
    shard: int
    cut_shape: Shape
    num_classes: int
    cut: str = ""  # the replica's cut, whose shape is `cut_shape`
    # Further cuts a batch may name, with their shapes (FedSplitX's deeper depth levels).
    other_cuts: Mapping[str, Shape] = field(default_factory=dict)
    # A U-shaped job: batches come without labels, and TailGradients finish their steps.
    u_shaped: bool = False

    def shape_of(self, cut: str) -> Shape | None:
        """The activation shape of a batch from `cut` ("" or the replica's: `cut_shape`);
        None for a cut this shard does not serve."""
        if not cut or cut == self.cut:
            return self.cut_shape
        return self.other_cuts.get(cut)


@dataclass(frozen=True, slots=True)
class BatchContent:
    """A SmashedBatch's cut, activations and labels fit the job (its addressing and client id
    are the chain's earlier checks)."""

    want: ShardExpectations

    def __call__(self, delivery: Delivery, message: SmashedBatch, /) -> Rejection | None:
        want = self.want
        z, y = message.activations, message.labels
        cut = message.cut
        # `ShardExpectations.shape_of` and `shape_problem`, inline: every batch passes here.
        shape = want.cut_shape if not cut or cut == want.cut else want.other_cuts.get(cut)
        if shape is None:
            served = sorted({want.cut, *want.other_cuts} - {""})
            detail = f"activations from cut {message.cut!r}; this job's cuts are {served}"
            return Rejection("bad_cut", detail)
        if tuple(z.shape[1:]) != tuple(shape) or z.shape[0] <= 0:
            return Rejection("bad_shape", str(shape_problem(z, shape)))
        if want.u_shaped:
            if y is None:
                return None
            return Rejection(
                "unexpected_labels",
                "a SmashedBatch with labels in a U-shaped job (model.tail is set): the labels "
                "stay on the client, whose tail computes the loss",
            )
        if y is None:
            return Rejection(
                "missing_labels",
                "a SmashedBatch without labels in a job that is not U-shaped (model.tail is "
                "unset): the server computes the loss and needs them",
            )
        if tuple(y.shape) != (z.shape[0],):
            return Rejection("bad_shape", f"labels of shape {list(y.shape)} for {z.shape[0]} rows")
        low, high = (int(v) for v in torch.aminmax(y))
        if low < 0 or high >= want.num_classes:
            detail = f"labels in [{low}, {high}], classes are 0..{want.num_classes - 1}"
            return Rejection("bad_labels", detail)
        return None


def shape_problem(z: torch.Tensor, shape: Shape) -> str | None:
    """Why activations `z` are not `[N>0, *shape]` (None: they are)."""
    if tuple(z.shape[1:]) == tuple(shape) and z.shape[0] > 0:
        return None
    want = ", ".join(str(d) for d in shape)
    return f"activations of shape {list(z.shape)}; the cut expects [N>0, {want}]"


class Known(Protocol):
    """What a replica knows of its clients: the round whose cohort is known, that cohort, and
    who it applied."""

    @property
    def cohort_round(self) -> int: ...

    @property
    def cohort(self) -> Mapping[str, int]: ...

    @property
    def seqs(self) -> Mapping[str, int]: ...


class FromClient(Protocol):
    @property
    def client(self) -> str: ...


class OfRound(Protocol):
    @property
    def client(self) -> str: ...

    @property
    def round(self) -> int: ...


@dataclass(frozen=True, slots=True)
class KnownClient:
    """A stranger's message is refused. Cohort members and clients already applied here are
    known without asking; `is_member` (the worker's member cache) is asked about the rest."""

    replica: Known
    is_member: Callable[[str], bool]

    def __call__(self, delivery: Delivery, message: FromClient, /) -> Rejection | None:
        client, replica = message.client, self.replica
        if client in replica.cohort or client in replica.seqs or self.is_member(client):
            return None
        return Rejection("unknown_client", f"client {client!r} is not a member of the job")


@dataclass(frozen=True, slots=True)
class CohortMember:
    """A batch's client is a member of the round's cohort, else of the job: the shared
    `InCohort` then `KnownClient` in one call, as every batch is asked both (a member of the
    cohort passes both at once)."""

    replica: Known
    is_member: Callable[[str], bool]

    def __call__(self, delivery: Delivery, message: OfRound, /) -> Rejection | None:
        client, replica = message.client, self.replica
        if client in replica.cohort:
            return None
        if message.round == replica.cohort_round:
            detail = f"client {client!r} is not in the cohort of round {replica.cohort_round + 1}"
            return Rejection("not_in_cohort", detail)
        if client in replica.seqs or self.is_member(client):
            return None
        return Rejection("unknown_client", f"client {client!r} is not a member of the job")


def not_u_shaped(delivery: Delivery, message: object, /) -> Rejection:
    """A TailGradient in a job whose model has no tail."""
    detail = "a TailGradient in a job that is not U-shaped (model.tail is unset)"
    return Rejection("not_u_shaped", detail)


def no_rounds(delivery: Delivery, message: object, /) -> Rejection:
    """Async mode has no rounds: a marker would reset the replica's sample count."""
    return Rejection("no_rounds", f"{type(message).__name__} in async mode")


def parse_cohort(message: RoundStart) -> tuple[dict[str, int] | None, Rejection | None]:
    """The `{client: samples}` of a RoundStart (addressed right), or why it is unusable."""
    cohort: dict[str, int] = {}
    for client, samples in message.participants.items():
        if not client or isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            detail = f"participant {client!r} with samples {samples!r}"
            return None, Rejection("bad_cohort", detail)
        cohort[client] = samples
    return cohort, None
