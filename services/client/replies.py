"""Why a delivery on a client's reply queue cannot be taken (docs/reliability.md, "Bad input",
the client rows): each check says why in words, or None. `ClientLink.poll` runs them once per
delivery and dead-letters what they refuse.
"""

from __future__ import annotations

from broker.messages import (
    Error,
    GradientReply,
    InferReply,
    Message,
    ServerOutput,
    SmashedBatch,
    WeightsAssignment,
    Welcome,
)
from models.split import SplitNet
from services.client.plan import RoundPlan, config_int

# What may arrive on a client's reply queue; anything else is dead-lettered.
REPLY_TYPES = (Welcome, WeightsAssignment, GradientReply, ServerOutput, Error, InferReply)


def reply_problem(
    message: Message,
    *,
    job: str,
    client: str,
    seq_base: int | None,
    next_seq: int,
    plan: RoundPlan,
    model: SplitNet,
) -> str | None:
    """Why `message` cannot be a reply to `client` of `job`, whose session numbers its batches
    from `seq_base` (None: not welcomed yet) up to `next_seq`; `plan` and `model` (the client's
    own) judge Welcomes and assignments."""
    kind = type(message).__name__
    if not isinstance(message, REPLY_TYPES):
        return f"{kind} does not belong on a client's reply queue"
    if message.job != job:
        return f"{kind} for job {message.job!r} on a queue of job {job!r}"
    if message.client != client:
        return f"{kind} for client {message.client!r} on the queue of {client!r}"
    if isinstance(message, GradientReply | ServerOutput):
        # An earlier seq may be a late copy of an answer already taken, or a previous
        # run's (every one before the Welcome): a duplicate, not an invalid message.
        if seq_base is not None and message.seq >= next_seq:
            return (
                f"{kind} for seq {message.seq}, never sent by this client "
                f"(its next seq is {next_seq})"
            )
        return None
    if isinstance(message, Welcome | WeightsAssignment):
        return fit_problem(message, plan, model)
    return None


def fit_problem(
    message: Welcome | WeightsAssignment, plan: RoundPlan, model: SplitNet
) -> str | None:
    """Why `message`'s settings or weights do not fit the client's `plan` and `model`."""
    if isinstance(message, WeightsAssignment) and not message.participate:
        return None
    kind = type(message).__name__
    try:
        plan.updated(message.config)
        config_int(message.config, "partition")
        config_int(message.config, "shard")
        if isinstance(message, Welcome):
            model.cut_index(message.cut)
    except ValueError as exc:  # ModelSpecError included
        return f"{kind}: {exc}"
    own = model.state_dict()
    for weights in (message.client_weights, message.aux_weights):
        for name, tensor in weights.items():
            if name not in own:
                return f"{kind}: unknown tensor {name!r} for this model"
            if tensor.shape != own[name].shape:
                return (
                    f"{kind}: {name}: shape {list(tensor.shape)}, the model has "
                    f"{list(own[name].shape)}"
                )
    return None


def gradient_problem(reply: GradientReply, batch: SmashedBatch) -> str | None:
    """Why `reply` cannot answer `batch`, when it is the answer (an ok one) to it."""
    if reply.seq != batch.seq or reply.status != "ok":
        return None
    shape = batch.activations.shape
    if reply.grad is not None and reply.grad.shape == shape:
        return None
    got = None if reply.grad is None else list(reply.grad.shape)
    return f"GradientReply seq {reply.seq}: gradient shape {got}, expected {list(shape)}"


def output_problem(output: ServerOutput, batch: SmashedBatch, model: SplitNet) -> str | None:
    """Why `output` cannot be the server's output for `batch`, when it answers it."""
    if output.seq != batch.seq:
        return None
    got = list(output.activations.shape)
    want: list[int] = [int(batch.activations.shape[0])]
    if model.tail is not None:
        want += model.server_output_shape()
    elif got[:1] == want:  # a model without a tail has no output shape: only the rows count
        return None
    if got == want:
        return None
    return f"ServerOutput seq {output.seq}: shape {got}, expected {want}"
