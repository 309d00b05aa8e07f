"""The message types of design §5.

Each message is a frozen dataclass whose field annotations are its wire schema (see
`broker.schema`): the base type picks how a field travels, `Annotated` markers add checks.
Every message carries `job`, `client`, `message_id` and `version`, the weights version the
sender computed with (not the wire schema version, which the codec carries as `v`).

Messages holding tensors compare by identity (`eq=False`): tensor `==` is elementwise, so the
generated `__eq__` would raise instead of answering.
"""

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Annotated, get_args

import torch

from broker.schema import (
    Finite,
    MessageSchema,
    NonEmpty,
    NonNegative,
    OneOf,
    TensorRule,
    build_schema,
)


def new_message_id() -> str:
    """A fresh random message id: 128 random bits as 32 hex digits (the uuid4 hex format
    without its version bits; a third of uuid4's cost when the caches are cold)."""
    return os.urandom(16).hex()


FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
LABEL_DTYPES = frozenset({torch.int64, torch.int32, torch.uint8})
MASK_DTYPES = frozenset({torch.bool, torch.uint8})
# Weight dicts may hold integer buffers (BatchNorm's num_batches_tracked) and quantised tensors.
WEIGHT_DTYPES = frozenset(
    {
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    }
)


ConfigValue = str | int | float | bool
JobName = Annotated[str, NonEmpty()]
ClientId = str
MessageId = Annotated[str, NonEmpty()]
Count = Annotated[int, NonNegative()]
Activations = Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
Labels = Annotated[torch.Tensor, TensorRule(LABEL_DTYPES, rank=1)]
Gradient = Annotated[torch.Tensor | None, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
Logits = Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]
Weights = Annotated[Mapping[str, torch.Tensor], TensorRule(WEIGHT_DTYPES, finite=True)]
Masks = Annotated[Mapping[str, torch.Tensor], TensorRule(MASK_DTYPES)]
Config = Mapping[str, ConfigValue]
Metrics = Mapping[str, float]
Info = Mapping[str, str]

# `GradientReply.status`: "ok" (applied; the gradient, for algorithms that wait for one),
# "stale" (the worker holds the seq and its answer is still to come), "gone" (a copy of a seq
# applied before whose gradient the worker no longer has: the client cannot wait it out),
# "rejected" (not applied: `reason` says why, e.g. "too_stale: ...").
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


# --- messages -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Join:
    """A client asks to take part in a job."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    samples: Count
    capability: Count = 0
    info: Info = field(default_factory=dict)


@dataclass(frozen=True, slots=True, eq=False)
class Welcome:
    """The coordinator admits a client: its shard, cut and starting weights."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    shard: Count
    cut: str
    round: Count
    client_weights: Weights
    aux_weights: Weights
    config: Config


@dataclass(frozen=True, slots=True)
class Leave:
    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Heartbeat:
    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    role: Annotated[str, NonEmpty()] = "client"


@dataclass(frozen=True, slots=True, eq=False)
class SmashedBatch:
    """Cut-layer activations of one minibatch and its labels; `seq` rises per client."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
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
class GradientReply:
    """The worker's answer to SmashedBatch `seq`: dL/dz (same shape as its activations)."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    seq: Count
    status: Annotated[str, OneOf(REPLY_STATUSES)]
    loss: Annotated[float, Finite()]
    correct: Count
    samples: Count
    grad: Gradient
    reason: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class WeightsUpdate:
    """A client's weights after its local round; `version` is the base version it started from."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    round: Count
    samples: Count
    client_weights: Weights
    aux_weights: Weights
    masks: Masks = field(default_factory=dict)
    metrics: Metrics = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundDropped:
    """A client gives up its local round `round` (based on `version`) and says why, on the
    updates queue, so the aggregator need not wait for its deadline to learn that no
    WeightsUpdate is coming. `ref_message_id` names the WeightsAssignment it answers (a reopened
    round's attempts share round and version); `detail` is for logs only."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    round: Count
    reason: Annotated[str, OneOf(DROP_REASONS)]
    ref_message_id: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True, eq=False)
class WeightsAssignment:
    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    round: Count
    participate: bool
    client_weights: Weights
    aux_weights: Weights
    config: Config


@dataclass(frozen=True, slots=True, eq=False)
class InferRequest:
    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    seq: Count
    activations: Activations


@dataclass(frozen=True, slots=True, eq=False)
class InferReply:
    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    seq: Count
    logits: Logits


@dataclass(frozen=True, slots=True)
class Error:
    """An error travelling as a reply (errors never cross processes as exceptions)."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    code: Annotated[str, NonEmpty()]
    reason: str
    ref_message_id: str = ""


@dataclass(frozen=True, slots=True)
class RoundStart:
    """Aggregator → shard queue, ahead of a round's batches: who takes part, with |D_k|.

    Queue order puts it before every SmashedBatch of the round, so a worker knows the cohort
    of MiniBatch-SFL's step barrier without a side channel. `client` is empty.
    """

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    round: Count
    shard: Count
    participants: Config


@dataclass(frozen=True, slots=True)
class RoundEnd:
    """Aggregator → shard queue, behind all of a round's batches: hand in the replica."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    round: Count
    shard: Count


@dataclass(frozen=True, slots=True)
class Event:
    """Fanout notice (version published, round opened/closed, member joined/left...)."""

    job: JobName
    client: ClientId
    message_id: MessageId
    version: Count
    kind: Annotated[str, NonEmpty()]
    data: Config


Message = (
    Join
    | Welcome
    | Leave
    | Heartbeat
    | SmashedBatch
    | GradientReply
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


def consistency_error(message: Message) -> str | None:
    """Cross-field checks the per-field schema cannot express; the reason, or None."""
    if isinstance(message, SmashedBatch):
        rows = message.activations.shape[0]
        if message.labels.shape != (rows,):
            return (
                f"SmashedBatch.labels: shape {list(message.labels.shape)} does not match "
                f"{rows} activation rows"
            )
        if message.cut and not _CUT_NAME.match(message.cut):
            return f"SmashedBatch.cut: {message.cut[:80]!r} is not a cut name"
    return None


# --- schema -------------------------------------------------------------------------------------

SCHEMAS: Mapping[str, MessageSchema] = MappingProxyType(
    {cls.__name__: build_schema(cls) for cls in MESSAGE_TYPES}
)
SCHEMAS_BY_CLASS: Mapping[type[Message], MessageSchema] = MappingProxyType(
    {schema.cls: schema for schema in SCHEMAS.values()}
)
