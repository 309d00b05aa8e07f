"""What a client's reply queue takes (`REPLY_TYPES`), and the checks of its rarer deliveries
(docs/reliability.md, "Bad input", the client rows): a Welcome's or an assignment's fit, a
U-shaped output's shape; each says why in words, or None. `ClientLink.problem` runs them
with its own checks of every reply's address and seq, and dead-letters what they refuse.
"""

from __future__ import annotations

from broker.messages import (
    Error,
    GradientReply,
    InferReply,
    ServerOutput,
    SmashedBatch,
    WeightsAssignment,
    Welcome,
)
from models.split import SplitNet
from services.client.plan import RoundPlan, config_int

# What may arrive on a client's reply queue; anything else is dead-lettered.
REPLY_TYPES = (Welcome, WeightsAssignment, GradientReply, ServerOutput, Error, InferReply)


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
