"""The message types: frozen dataclasses whose field annotations are the wire schema
(docs/architecture.md, "Messages on the wire").

This module must not use `from __future__ import annotations`: the codec needs the field types
as real objects, not strings. Messages holding tensors compare by identity (`eq=False`): tensor
`==` is elementwise, so the generated `__eq__` would raise instead of answering.
"""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Annotated, get_args

import torch

from broker.tensors import WIRE_DTYPES


def new_message_id() -> str:
    """A fresh random message id: 128 random bits as 32 hex digits (the uuid4 hex format
    without its version bits; a third of uuid4's cost when the caches are cold)."""
    return os.urandom(16).hex()


class Marker(Enum):
    """What a field's value must be beyond its type."""

    NON_EMPTY = "a non-empty string"
    NON_NEGATIVE = "an integer >= 0"
    FINITE = "a float neither NaN nor infinite"


@dataclass(frozen=True, slots=True)
class OneOf:
    """A string restricted to `choices`."""

    choices: frozenset[str]


@dataclass(frozen=True, slots=True)
class TensorRule:
    """What a tensor field (or every value of a tensor-map field) may hold; `finite` applies to
    floating-point dtypes only (see `WEIGHT_DTYPES`)."""

    dtypes: frozenset[torch.dtype]
    finite: bool = False
    rank: int | None = None
    min_rank: int = 0


FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
LABEL_DTYPES = frozenset({torch.int64, torch.int32, torch.uint8})
MASK_DTYPES = frozenset({torch.bool, torch.uint8})
# Weight dicts may hold any dtype that travels: integer buffers (BatchNorm's
# num_batches_tracked, which `finite` lets through), quantised tensors, float64.
WEIGHT_DTYPES = frozenset(d.torch_dtype for d in WIRE_DTYPES.values())


ConfigValue = str | int | float | bool
JobName = Annotated[str, Marker.NON_EMPTY]
ClientId = str
MessageId = Annotated[str, Marker.NON_EMPTY]
Count = Annotated[int, Marker.NON_NEGATIVE]
Activations = Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
# None in a U-shaped job only, where the labels stay on the client (the worker checks which).
Labels = Annotated[torch.Tensor | None, TensorRule(LABEL_DTYPES, rank=1)]
Gradient = Annotated[torch.Tensor | None, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
Logits = Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
Weights = Annotated[Mapping[str, torch.Tensor], TensorRule(WEIGHT_DTYPES, finite=True)]
Masks = Annotated[Mapping[str, torch.Tensor], TensorRule(MASK_DTYPES)]
Config = Mapping[str, ConfigValue]
Metrics = Mapping[str, float]
Info = Mapping[str, str]

# `GradientReply.status`, as docs/architecture.md's "Conventions the roles share" defines them.
REPLY_STATUSES = frozenset({"ok", "stale", "gone", "rejected"})
# Why a client gives up its local round (`RoundDropped.reason`): its model diverged (weights or
# activations hold NaN or infinities), or anything else ended the round (an error reply, no
# gradient after every retry, a superseding assignment). A closed set, because the aggregator
# counts drops by reason and quotes the counts in a failed job's status.
NON_FINITE = "non_finite"
ABORTED = "aborted"
DROP_REASONS = frozenset({NON_FINITE, ABORTED})
# A model's block (cut) names: models.split.check_name's rule, bounded in length.
_CUT_NAME = re.compile(r"[A-Za-z0-9_]{1,128}\Z")


@dataclass(frozen=True, slots=True, eq=False)
class _Common:
    """The fields every message starts with (a subclass without tensors compares by value)."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count


@dataclass(frozen=True, slots=True)
class Join(_Common):
    """A client asks to take part in a job."""

    samples: Count
    capability: Count = 0
    info: Info = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Welcome(_Common):
    """The coordinator admits a client: its shard, cut and starting weights, and the first seq
    of its session (`seq_base`): the session numbers its SmashedBatches contiguously from there.
    0 only from a coordinator without seq bases (the codec reads no body without the field)."""

    shard: Count
    cut: str
    round: Count
    client_weights: Weights
    aux_weights: Weights
    config: Config
    seq_base: Count = 0


@dataclass(frozen=True, slots=True)
class Leave(_Common):
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat(_Common):
    role: Annotated[str, Marker.NON_EMPTY] = "client"


@dataclass(frozen=True, slots=True)
class HostHeartbeat(_Common):
    """A client host's heartbeat for the clients it runs (`client` is the host's id): each
    member's id and the weights version it knows; one message per host and interval instead
    of one per client (docs/architecture.md, "Client hosts")."""

    members: Mapping[str, int]


@dataclass(frozen=True, slots=True, eq=False)
class SmashedBatch(_Common):
    """Cut-layer activations of one minibatch and its labels (none in a U-shaped job); `seq`
    rises per client."""

    seq: Count
    shard: Count
    round: Count
    step: Count
    activations: Activations
    labels: Labels
    # Steps this client takes in the round (MiniBatch-SFL's barrier stops expecting it after).
    steps: Count = 0
    # The cut the activations come from ("": the job's cut). FedSplitX's clients sit at
    # different depths; the worker checks the shape against this cut and trains from it.
    cut: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class GradientReply(_Common):
    """The worker's answer to SmashedBatch `seq`: dL/dz (same shape as its activations)."""

    seq: Count
    status: Annotated[str, OneOf(REPLY_STATUSES)]
    loss: Annotated[float, Marker.FINITE]
    correct: Count
    samples: Count
    grad: Gradient
    reason: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class ServerOutput(_Common):
    """U-shaped split, worker → client: the server's last block's output for SmashedBatch
    `seq`, on which the client's tail computes the loss (docs/architecture.md, "U-shaped
    split")."""

    seq: Count
    activations: Activations


@dataclass(frozen=True, slots=True, eq=False)
class TailGradient(_Common):
    """U-shaped split, client → shard queue: dL/d(the ServerOutput of `seq`), with which the
    worker finishes the step; it answers with the GradientReply (dL/dz) of `seq`."""

    seq: Count
    shard: Count
    round: Count
    grad: Activations


@dataclass(frozen=True, slots=True, eq=False)
class WeightsUpdate(_Common):
    """A client's weights after its local round; `version` is the base version it started from."""

    round: Count
    samples: Count
    client_weights: Weights
    aux_weights: Weights
    masks: Masks = field(default_factory=dict)
    metrics: Metrics = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundDropped(_Common):
    """A client gives up its local round (docs/architecture.md, sync round step 4).
    `ref_message_id` names the WeightsAssignment it answers (a reopened round's attempts share
    round and version); `detail` is for logs only."""

    round: Count
    reason: Annotated[str, OneOf(DROP_REASONS)]
    ref_message_id: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class WeightsAssignment(_Common):
    round: Count
    participate: bool
    client_weights: Weights
    aux_weights: Weights
    config: Config


@dataclass(frozen=True, slots=True, eq=False)
class InferRequest(_Common):
    seq: Count
    activations: Activations


@dataclass(frozen=True, slots=True, eq=False)
class InferReply(_Common):
    seq: Count
    logits: Logits


@dataclass(frozen=True, slots=True)
class Error(_Common):
    """An error travelling as a reply (errors never cross processes as exceptions)."""

    code: Annotated[str, Marker.NON_EMPTY]
    reason: str
    ref_message_id: str = ""


@dataclass(frozen=True, slots=True)
class RoundStart(_Common):
    """Aggregator → shard queue, ahead of a round's batches: who takes part, with |D_k|
    (`client` is empty; why a marker: docs/architecture.md, "Queues")."""

    round: Count
    shard: Count
    participants: Config


@dataclass(frozen=True, slots=True)
class RoundEnd(_Common):
    """Aggregator → shard queue, behind all of a round's batches: hand in the replica."""

    round: Count
    shard: Count


@dataclass(frozen=True, slots=True)
class Event(_Common):
    """Fanout notice (version published, round opened/closed, member joined/left...)."""

    kind: Annotated[str, Marker.NON_EMPTY]
    data: Config


Message = (
    Join
    | Welcome
    | Leave
    | Heartbeat
    | HostHeartbeat
    | SmashedBatch
    | GradientReply
    | ServerOutput
    | TailGradient
    | WeightsUpdate
    | RoundDropped
    | WeightsAssignment
    | InferRequest
    | InferReply
    | Error
    | RoundStart
    | RoundEnd
    | Event
)
MESSAGE_TYPES: tuple[type[Message], ...] = get_args(Message)


# The message types `consistency_error` checks: the codec asks it about these only.
CROSS_CHECKED: frozenset[type[Message]] = frozenset({SmashedBatch})


def consistency_error(message: Message) -> str | None:
    """Cross-field checks the per-field schema cannot express (`CROSS_CHECKED` types); the
    reason, or None."""
    if isinstance(message, SmashedBatch):
        rows = message.activations.shape[0]
        if message.labels is not None and message.labels.shape != (rows,):
            return (
                f"SmashedBatch.labels: shape {list(message.labels.shape)} does not match "
                f"{rows} activation rows"
            )
        if message.cut and not _CUT_NAME.match(message.cut):
            return f"SmashedBatch.cut: {message.cut[:80]!r} is not a cut name"
    return None
