"""What a valid message on a shard queue looks like, checked without any state of the shard:
pure functions a runner calls before it looks at its replica (each unit-tested alone).

A check returns `(code, detail)` for a message to dead-letter (the code: its counter key and the
reason's head), else None.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from broker.messages import RoundEnd, RoundStart, SmashedBatch, TailGradient
from models.split import Shape
from services.security.identity import client_id_problem

Rejection = tuple[str, str]


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


def check_addressing(
    message: RoundStart | RoundEnd | SmashedBatch | TailGradient, want: ShardExpectations
) -> Rejection | None:
    if message.job != want.job:
        return "wrong_job", f"job {message.job!r} on a queue of job {want.job!r}"
    if message.shard != want.shard:
        return "wrong_shard", f"shard {message.shard} on the queue of shard {want.shard}"
    return None


def check_sender(message: SmashedBatch | TailGradient, want: ShardExpectations) -> Rejection | None:
    addressing = check_addressing(message, want)
    if addressing is not None:
        return addressing
    if not message.client:
        return "bad_client", f"{type(message).__name__} without a client id"
    bad_id = client_id_problem(message.client)
    if bad_id is not None:
        return "bad_client", bad_id
    return None


def check_batch(message: SmashedBatch, want: ShardExpectations) -> Rejection | None:
    problem = check_sender(message, want)
    if problem is not None:
        return problem
    z, y = message.activations, message.labels
    shape = want.shape_of(message.cut)
    if shape is None:
        served = sorted({want.cut, *want.other_cuts} - {""})
        return "bad_cut", f"activations from cut {message.cut!r}; this job's cuts are {served}"
    wrong_shape = shape_problem(z, shape)
    if wrong_shape is not None:
        return "bad_shape", wrong_shape
    if want.u_shaped:
        if y is None:
            return None
        return "unexpected_labels", (
            "a SmashedBatch with labels in a U-shaped job (model.tail is set): the labels "
            "stay on the client, whose tail computes the loss"
        )
    if y is None:
        return "missing_labels", (
            "a SmashedBatch without labels in a job that is not U-shaped (model.tail is "
            "unset): the server computes the loss and needs them"
        )
    if tuple(y.shape) != (z.shape[0],):
        return "bad_shape", f"labels of shape {list(y.shape)} for {z.shape[0]} rows"
    low, high = (int(v) for v in torch.aminmax(y))
    if low < 0 or high >= want.num_classes:
        return "bad_labels", f"labels in [{low}, {high}], classes are 0..{want.num_classes - 1}"
    return None


def shape_problem(z: torch.Tensor, shape: Shape) -> str | None:
    """Why activations `z` are not `[N>0, *shape]` (None: they are)."""
    if tuple(z.shape[1:]) == tuple(shape) and z.shape[0] > 0:
        return None
    want = ", ".join(str(d) for d in shape)
    return f"activations of shape {list(z.shape)}; the cut expects [N>0, {want}]"


def check_membership(
    message: SmashedBatch, cohort_round: int, cohort: Mapping[str, int]
) -> Rejection | None:
    """A batch of a round whose cohort is known must come from a member of it. Other rounds'
    (a straggler's, a round whose RoundStart this shard never saw) pass: the cohort is the
    barrier's business, not a licence to train."""
    if message.round == cohort_round and message.client not in cohort:
        return "not_in_cohort", (
            f"client {message.client!r} is not in the cohort of round {cohort_round + 1}"
        )
    return None


def check_marker(message: RoundStart | RoundEnd, current_version: int) -> Rejection | None:
    """Round markers come from the aggregator: round r belongs to version r + 1, and only a
    version already published can have a round (a marker from the future is forged)."""
    kind = type(message).__name__
    if message.round >= message.version:
        return "bad_marker", (
            f"{kind} of round {message.round} names version {message.version}; "
            "round r trains version r + 1"
        )
    if message.version > current_version:
        return "bad_marker", (
            f"{kind} names version {message.version}, beyond the published {current_version}"
        )
    return None


def parse_cohort(message: RoundStart) -> tuple[dict[str, int] | None, Rejection | None]:
    """The `{client: samples}` of a RoundStart (addressed right), or why it is unusable."""
    cohort: dict[str, int] = {}
    for client, samples in message.participants.items():
        if not client or isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            return None, ("bad_cohort", f"participant {client!r} with samples {samples!r}")
        cohort[client] = samples
    return cohort, None
