"""The U-shaped split (label privacy): the client runs the blocks up to the cut and a tail
after the server's part (`model.tail`), so the loss, and with it the labels, stays on the
client. The server's step comes in two halves around the client's tail: `forward_open` keeps
each batch's graph, `backward_open` finishes it with the gradients the clients' tails send.
The protocol: docs/architecture.md, "U-shaped split".

The step is the plain split step with the loss moved: for batches n with weights p_n the
server steps on `sum_n p_n grad L_n / sum_n p_n` and each client gets its own `dL_n/dz_n`
at the pre-update weights, as `sfl.weighted_step` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from models.state import client_state
from services.algorithms.base import LocalRound, OpenStep, RoundResult, StrategyBase


def forward_open(
    server: nn.Module, zs: Sequence[torch.Tensor], weights: Sequence[float], *, concat: bool
) -> OpenStep:
    """The server's forward on each batch, graphs kept. `concat`: one forward over the
    concatenation (folded SFL; BatchNorm sees the combined batch), else one per batch
    (MiniBatch-SFL's `h(w_s; z_n)`)."""
    if len(zs) != len(weights) or not zs:
        raise ValueError(f"need matching non-empty inputs, got {len(zs)} and {len(weights)}")
    if any(w <= 0 for w in weights):
        raise ValueError(f"batch weights must be positive, got {list(weights)}")
    device = next(server.parameters()).device
    # The wire may carry float16/bfloat16; the server always computes in float32.
    inputs = [z.detach().to(device=device, dtype=torch.float32).requires_grad_(True) for z in zs]
    if concat and len(inputs) > 1:
        joined = server(torch.cat(inputs))
        outputs = list(torch.split(joined, [int(z.shape[0]) for z in inputs]))
    else:
        outputs = [server(z) for z in inputs]
    return OpenStep(inputs, outputs, [float(w) for w in weights])


def backward_open(
    optimizer: torch.optim.Optimizer, step: OpenStep, grads: Sequence[torch.Tensor | None]
) -> list[torch.Tensor | None]:
    """Finish `step` with each batch's dL_n/d(output_n) (None: its client never sent one, and
    the step goes on over the others, their weights renormalised); returns each batch's
    dL_n/dz_n (None where its gradient was missing). One optimizer step."""
    present = [i for i, g in enumerate(grads) if g is not None]
    if len(grads) != len(step.outputs) or not present:
        raise ValueError(f"need a gradient per output and at least one, got {len(grads)}")
    total = sum(step.weights[i] for i in present)
    outputs, scaled = [], []
    for i in present:
        grad = grads[i]
        assert grad is not None
        out = step.outputs[i]
        outputs.append(out)
        scaled.append(grad.to(device=out.device, dtype=out.dtype) * (step.weights[i] / total))
    optimizer.zero_grad(set_to_none=True)
    torch.autograd.backward(outputs, scaled)
    optimizer.step()
    result: list[torch.Tensor | None] = [None] * len(grads)
    for i in present:
        z = step.inputs[i]
        assert z.grad is not None
        result[i] = (z.grad * (total / step.weights[i])).detach()
    return result


def u_round(strategy: StrategyBase, r: LocalRound) -> RoundResult:
    """The client's side of a U-shaped round: body forward, the server's output back, the
    tail's loss here, its gradient out, dL/dz back, then one step of body and tail together.
    The training loss and accuracy are the client's own (the server never sees a label);
    z goes out through `strategy.smashed` (the defences on smashed data)."""
    body, tail = r.model.client_blocks(r.cut), r.model.tail_blocks()
    body.train()
    tail.train()
    optimizer = r.hyper.client_optimizer([*body.parameters(), *tail.parameters()])
    samples = correct = 0
    loss_sum = 0.0
    for step, (x, y) in enumerate(r.batches):
        smashed = strategy.smashed(r, x, body(x), step)
        out = r.channel.forward(smashed.wire(), step, r.steps)
        out = out.to(dtype=smashed.sent.dtype, copy=True).requires_grad_(True)
        logits = tail(out)
        loss = r.hyper.loss(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        assert out.grad is not None
        smashed.backward(r.channel.backward(out.grad))
        optimizer.step()
        rows = int(y.shape[0])
        samples += rows
        loss_sum += float(loss.detach()) * rows
        correct += int((logits.detach().argmax(dim=1) == y).sum())
    metrics = {"train_samples": float(samples)}
    if samples:
        metrics.update(train_loss=loss_sum / samples, train_accuracy=correct / samples)
    return RoundResult(client_state(r.model, r.cut), metrics=metrics)
