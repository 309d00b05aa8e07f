"""Server-side steps of split learning as pure functions over a module and its optimizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class ServerStepResult:
    """Per input batch: the gradient of its own loss w.r.t. its smashed data, loss, #correct."""

    grads: list[torch.Tensor]
    losses: list[float]
    correct: list[int]


def _prepare(z: torch.Tensor, device: torch.device) -> torch.Tensor:
    # The wire may carry float16/bfloat16; the server always computes in float32.
    return z.detach().to(device=device, dtype=torch.float32).requires_grad_(True)


def sequential_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    z: torch.Tensor,
    y: torch.Tensor,
    *,
    loss_scale: float = 1.0,
) -> ServerStepResult:
    """One SFL server step on one client's batch: `theta <- theta - eta * s * grad l(theta; z)`.

    Returns `s * dl/dz` (SplitGP scales the server loss by `1 - gamma`; plain SFL uses s = 1).
    """
    device = next(server.parameters()).device
    zz = _prepare(z, device)
    yy = y.to(device=device, dtype=torch.long)
    logits = server(zz)
    loss = F.cross_entropy(logits, yy)
    optimizer.zero_grad(set_to_none=True)
    (loss * loss_scale).backward()
    optimizer.step()
    assert zz.grad is not None
    correct = int((logits.detach().argmax(dim=1) == yy).sum())
    return ServerStepResult([zz.grad.detach()], [float(loss.detach())], [correct])


def weighted_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    zs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    p: Sequence[float],
    *,
    concat: bool = False,
) -> ServerStepResult:
    """MiniBatch-SFL's server step, equation (3) of Huang, Tian and Tang:

    `w_s <- w_s - eta_s * sum_n p_n grad h(w_s; z_n) / sum_n p_n`, and each client n gets
    `dh(w_s; z_n)/dz_n` computed at the pre-update `w_s`.

    Each client's batch goes through the server separately, so batch-dependent layers
    (BatchNorm) see per-client batches exactly as `h(w_s; z_n)` in the equation; one backward
    over the weighted sum then yields both the step and every client's own gradient
    (rescaled by `sum p / p_n`, exact because the per-client graphs are disjoint).

    `concat=True` runs one forward on the concatenated batches instead (what a GPU wants when
    a worker folds several queued messages into one step): identical without batch-coupled
    layers, and with BatchNorm the statistics are those of the combined batch.
    """
    if not (len(zs) == len(ys) == len(p)) or not zs:
        raise ValueError(f"need matching non-empty inputs, got {len(zs)}, {len(ys)}, {len(p)}")
    if any(pn <= 0 for pn in p):
        raise ValueError(f"client weights must be positive, got {list(p)}")
    device = next(server.parameters()).device
    total_p = float(sum(p))
    inputs = [_prepare(z, device) for z in zs]
    labels = [y.to(device=device, dtype=torch.long) for y in ys]
    if concat:
        joined = server(torch.cat(inputs))
        outputs = list(torch.split(joined, [int(z.shape[0]) for z in inputs]))
    else:
        outputs = [server(z) for z in inputs]
    losses: list[torch.Tensor] = []
    correct: list[int] = []
    for logits, y in zip(outputs, labels, strict=True):
        losses.append(F.cross_entropy(logits, y))
        correct.append(int((logits.detach().argmax(dim=1) == y).sum()))
    objective = sum((pn / total_p) * ln for pn, ln in zip(p, losses, strict=True))
    optimizer.zero_grad(set_to_none=True)
    assert isinstance(objective, torch.Tensor)
    objective.backward()
    optimizer.step()
    grads = []
    for z, pn in zip(inputs, p, strict=True):
        assert z.grad is not None
        grads.append((z.grad * (total_p / pn)).detach())
    return ServerStepResult(grads, [float(ln.detach()) for ln in losses], correct)
