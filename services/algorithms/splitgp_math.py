"""SplitGP's tensor math (Han et al.), as pure functions: the client objective, the scaled
server step, lambda-mixing of personalised models, and the entropy rule of split inference.

Notation: client-side blocks `phi`, the client's head `h` at the cut, server-side blocks
`theta`; `F_k = gamma * l(h(phi(x)), y) + (1 - gamma) * l(theta(phi(x)), y)`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from services.algorithms.server_math import ServerStepResult, sequential_step, weighted_step

State = Mapping[str, torch.Tensor]


# --- training -----------------------------------------------------------------------------------


def client_objective(
    head_logits: torch.Tensor,
    labels: torch.Tensor,
    z: torch.Tensor,
    server_grad: torch.Tensor,
    gamma: float,
) -> torch.Tensor:
    """A scalar whose gradient w.r.t. the client's parameters is `grad F_k`.

    `server_grad` is what the worker returned: `(1 - gamma) * dl_S/dz`, already scaled, so the
    server's part enters as the surrogate `<z, server_grad>` (its gradient w.r.t. z is exactly
    `server_grad`), and the head's part as `gamma * l(h(z), y)`.
    """
    head_loss = F.cross_entropy(head_logits, labels)
    surrogate = (z * server_grad.to(device=z.device, dtype=z.dtype)).sum()
    return gamma * head_loss + surrogate


class ScaleGrad(nn.Module):
    """`module` whose output gradient is multiplied by `scale` on the way back.

    The forward value is exactly the module's (`y + s*(y - y)` with the second term detached to
    zero); every gradient flowing through it, to the module's parameters and to its input, is
    `scale` times the unscaled one: the same as scaling the loss, for any loss on the output.
    """

    def __init__(self, module: nn.Module, scale: float) -> None:
        super().__init__()
        self.module = module
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.module(x)
        return y.detach() + self.scale * (y - y.detach())


def scaled_server_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    zs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    scale: float,
) -> ServerStepResult:
    """SplitGP's server step, eq. (8): `theta <- theta - eta * (1-gamma) * grad l_S`, and each
    batch's `(1-gamma) * dl_S/dz` for its client (`scale` = 1 - gamma).

    One batch: SFL's sequential step with the loss scaled. Several (a worker folding queued
    messages): one step on their concatenation, each batch weighted by its rows, the returned
    gradient being each batch's own, as in SFL's fold. Losses are the unscaled `l_S`.
    """
    if len(zs) == 1:
        return sequential_step(server, optimizer, zs[0], ys[0], loss_scale=scale)
    return weighted_step(
        ScaleGrad(server, scale),
        optimizer,
        zs,
        ys,
        [float(y.shape[0]) for y in ys],
        concat=True,
    )


# --- aggregation --------------------------------------------------------------------------------


def mix(own: State, shared: State, lam: float) -> dict[str, torch.Tensor]:
    """`lam * own + (1 - lam) * shared`, name by name.

    Integer tensors (BatchNorm's `num_batches_tracked`) are counters, not parameters: the
    client keeps its own. Computed in float64 and cast back, like the averages.
    """
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lambda must be in [0, 1], got {lam}")
    if set(own) != set(shared):
        diff = sorted(set(own) ^ set(shared))
        raise ValueError(f"cannot mix states with different tensor names: {diff[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name, mine in own.items():
        other = shared[name]
        if mine.shape != other.shape:
            raise ValueError(f"{name}: shape {tuple(mine.shape)} vs {tuple(other.shape)}")
        if not mine.is_floating_point():
            out[name] = mine.detach().clone()
            continue
        mixed = lam * mine.detach().to(torch.float64) + (1.0 - lam) * other.detach().to(
            torch.float64
        )
        out[name] = mixed.to(mine.dtype)
    return out


# --- split inference ----------------------------------------------------------------------------


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Per row, `E = -sum_q p_q log p_q` of `softmax(logits)`, in nats (0 <= E <= log C)."""
    log_p = F.log_softmax(logits.detach().to(torch.float64), dim=1)
    # p * log p -> 0 as p -> 0; log_softmax of finite logits is finite, so no 0 * inf here.
    return -(log_p.exp() * log_p).sum(dim=1)


def stays_local(entropies: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which rows the client answers itself: `E <= E_th` (a row exactly at it stays local)."""
    return entropies <= threshold


def split_predictions(
    head_logits: torch.Tensor, server_logits: torch.Tensor, local: torch.Tensor
) -> torch.Tensor:
    """The class of each row: the head's where `local`, the server's elsewhere.

    `server_logits` holds one row per offloaded row (`~local`), in order.
    """
    predicted = head_logits.argmax(dim=1)
    offloaded = ~local
    if int(offloaded.sum()) != server_logits.shape[0]:
        raise ValueError(
            f"{int(offloaded.sum())} rows offloaded but {server_logits.shape[0]} server answers"
        )
    if server_logits.shape[0]:
        predicted[offloaded] = server_logits.argmax(dim=1).to(predicted.device)
    return predicted


@dataclass(frozen=True)
class SweepPoint:
    """Split inference at one threshold: accuracy and the fraction of rows sent to the server."""

    threshold: float
    accuracy: float
    offloaded: float
    rows: int


def sweep(
    entropies: torch.Tensor,
    head_correct: torch.Tensor,
    server_correct: torch.Tensor,
    thresholds: Sequence[float],
) -> list[SweepPoint]:
    """Split inference at each threshold, from per-row entropies and per-row correctness of
    the head's and the server's answers (both computed once for every row)."""
    rows = int(entropies.shape[0])
    points = []
    for threshold in thresholds:
        local = stays_local(entropies, threshold)
        correct = torch.where(local, head_correct, server_correct)
        points.append(
            SweepPoint(
                threshold=float(threshold),
                accuracy=float(correct.sum()) / rows if rows else float("nan"),
                offloaded=float((~local).sum()) / rows if rows else float("nan"),
                rows=rows,
            )
        )
    return points
