"""SplitFed (Thapa et al.): SFL-V2 (one shared server model, S=1), SFL-V1 (one per client,
S=K) and the sharded middle ground; the shard count is the only difference between them.

Client: forward the body, send z, backprop the returned dL/dz. Worker: one step per message
(or one step over a few folded messages). Aggregation: client sides FedAvg-ed with
alpha_k = |D_k| / sum |D_i|, shard replicas averaged by the samples they trained on (the
base's `average_round`). The server step itself, `weighted_step`, is shared with MiniBatch-SFL
and SplitGP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import nn

from models.state import client_state
from services.algorithms.base import (
    CohortBatch,
    LocalRound,
    OpenStep,
    RoundResult,
    ServerSide,
    StepResults,
    StrategyBase,
    algorithm,
)
from services.algorithms.recipe import LossFn, cross_entropy
from services.algorithms.ushape import forward_open, u_round


@dataclass(frozen=True)
class ServerStepResult:
    """Per input batch: the gradient of its own loss w.r.t. its smashed data, loss, #correct."""

    grads: list[torch.Tensor]
    losses: list[float]
    correct: list[int]

    def rows(self) -> StepResults:
        return list(zip(self.grads, self.losses, self.correct, strict=True))


def weighted_step(
    server: nn.Module,
    optimizer: torch.optim.Optimizer,
    zs: Sequence[torch.Tensor],
    ys: Sequence[torch.Tensor],
    p: Sequence[float],
    *,
    concat: bool = False,
    loss_scale: float = 1.0,
    loss: LossFn = cross_entropy,
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
    layers, and with BatchNorm the statistics are those of the combined batch. One batch is
    SFL's plain step `theta <- theta - eta * s * grad l(theta; z)`.

    `loss_scale` s scales the step and the returned gradients, `s * dl/dz` (SplitGP's
    `1 - gamma`, eq. 8); the reported losses are unscaled.
    """
    # Inline, not `ushape.forward_open`: this is every SFL batch's path (docs/architecture.md,
    # "A batch's round trip"), which stays within its files.
    if not (len(zs) == len(ys) == len(p)) or not zs:
        raise ValueError(f"need matching non-empty inputs, got {len(zs)}, {len(ys)}, {len(p)}")
    if any(pn <= 0 for pn in p):
        raise ValueError(f"client weights must be positive, got {list(p)}")
    device = next(server.parameters()).device
    total_p = float(sum(p))
    # The wire may carry float16/bfloat16; the server always computes in float32.
    inputs = [z.detach().to(device=device, dtype=torch.float32).requires_grad_(True) for z in zs]
    labels = [y.to(device=device, dtype=torch.long) for y in ys]
    if concat and len(inputs) > 1:
        joined = server(torch.cat(inputs))
        outputs = list(torch.split(joined, [int(z.shape[0]) for z in inputs]))
    else:
        outputs = [server(z) for z in inputs]
    losses: list[torch.Tensor] = []
    correct: list[int] = []
    for logits, y in zip(outputs, labels, strict=True):
        losses.append(loss(logits, y))
        correct.append(int((logits.detach().argmax(dim=1) == y).sum()))
    objective = sum((pn / total_p) * ln for pn, ln in zip(p, losses, strict=True))
    optimizer.zero_grad(set_to_none=True)
    assert isinstance(objective, torch.Tensor)
    (objective * loss_scale).backward()
    optimizer.step()
    grads = []
    for z, pn in zip(inputs, p, strict=True):
        assert z.grad is not None
        grads.append((z.grad * (total_p / pn)).detach())
    return ServerStepResult(grads, [float(ln.detach()) for ln in losses], correct)


@dataclass(frozen=True)
class SFLServer(ServerSide):
    """SFL's workers: one rows-weighted step over a few folded messages (`step`), and the
    U-shaped forward over one concatenated batch. `loss_scale` scales the step and the
    gradients (SplitGP's `1 - gamma`)."""

    loss_scale: float = 1.0

    def step(
        self,
        server: nn.Module,
        optimizer: torch.optim.Optimizer,
        batches: Sequence[CohortBatch],
        *,
        loss: LossFn = cross_entropy,
    ) -> StepResults:
        """One step over the batches' concatenation, each weighted by its rows: for several
        folded messages, the step a single batch of all those rows would take."""
        # `weighted_step`'s rows zipped here, not by `ServerStepResult.rows`: every SFL
        # batch's path (docs/architecture.md, "A batch's round trip") stays short.
        r = weighted_step(
            server,
            optimizer,
            [b.activations for b in batches],
            [b.labels for b in batches],
            [float(b.labels.shape[0]) for b in batches],
            concat=True,
            loss_scale=self.loss_scale,
            loss=loss,
        )
        return list(zip(r.grads, r.losses, r.correct, strict=True))

    def forward(
        self, server: nn.Module, zs: Sequence[torch.Tensor], weights: Sequence[float]
    ) -> OpenStep:
        """Rows-weighted over one concatenated forward, as `step`."""
        if not self.u_shaped:
            return super().forward(server, zs, weights)
        return forward_open(server, zs, [float(z.shape[0]) for z in zs], concat=True)


@algorithm("sfl_v1", shards="per_client")
@algorithm("sfl_v2", shards="one")
@algorithm("sfl")
class SFL(StrategyBase):
    """SFL-V1 / SFL-V2 / sharded SFL; a worker may fold queued messages into one step."""

    name: str = "sfl"

    @cached_property
    def server(self) -> ServerSide | None:
        return SFLServer(u_shaped=True)

    def client_round(self, r: LocalRound) -> RoundResult:
        """Plain split training of the client side: every step waits for the server's dL/dz
        (U-shaped: `ushape.u_round`)."""
        if r.model.tail is not None:
            return u_round(self, r)
        body = r.model.client_blocks(r.cut)
        body.train()
        optimizer = r.hyper.client_optimizer(body.parameters())
        # Decided once a round: with every defence off, nothing stands between z and the wire
        # (what `self.smashed` would hand back), and the defences' code stays off the path.
        defended = self.defences.active
        samples = 0
        for step, (x, y) in enumerate(r.batches):
            z = body(x)
            if defended:
                smashed = self.smashed(r, x, z, step)
                grad = r.channel.exchange(smashed.wire(), y, step, r.steps)
                optimizer.zero_grad(set_to_none=True)
                smashed.backward(grad)
            else:
                grad = r.channel.exchange(z.detach(), y, step, r.steps)
                optimizer.zero_grad(set_to_none=True)
                z.backward(grad.to(device=z.device, dtype=z.dtype))
            optimizer.step()
            samples += int(y.shape[0])
        return RoundResult(client_state(r.model, r.cut), metrics={"train_samples": float(samples)})
