"""SplitGP (Han et al., "SplitGP: Achieving Both Generalization and Personalization in Federated
Learning"): model `[phi, h, theta]`, where the client holds `phi` (blocks up to the cut) and
`h` (its head at the cut) and the workers hold `theta` (the blocks after it).

Client, per minibatch: `F_k = gamma * l(h(phi(x)), y) + (1 - gamma) * l(theta(phi(x)), y)`;
the worker returns `(1 - gamma) * dl_S/dz` and steps `theta` with the same factor (eq. 8); the
client adds `gamma` times its head's gradient. Aggregation: `theta` averaged over the shard
replicas by the samples they trained on (alpha_k), `phi` and `h` averaged with alpha_k into the
global blobs, and every client's personal blobs mixed
`phi_k <- lam * phi_k + (1 - lam) * phi_bar` (same for `h_k`), see `personalise`.

Split inference: a client answers with its head when the entropy of its softmax is <= E_th,
else it sends `phi_k(x)` to the workers (`services.client.inference`, `workers.inference`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from broker.messages import ConfigValue
from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from models.state import client_state, head_state
from services.algorithms.averaging import weighted_average
from services.algorithms.base import (
    ClientContext,
    ClientUpdate,
    CohortBatch,
    Hyper,
    RoundResult,
    ShardReplica,
    SmashedChannel,
    VersionWeights,
)
from services.algorithms.sfl import split_initial_weights
from services.algorithms.splitgp_eval import SWEEP_THRESHOLDS, version_metrics
from services.algorithms.splitgp_math import client_objective, mix, scaled_server_step
from services.config.algorithms import SplitGPSection

CLIENT = BlobRef(CLIENT_PART)
SERVER = BlobRef(SERVER_PART)
AUX = BlobRef(AUX_PART)


def personalise(
    previous: VersionWeights,
    updates: Sequence[ClientUpdate],
    lam: float,
) -> VersionWeights:
    """The client-side blobs of the next version: global means and every personal model.

    `phi_bar`, `h_bar` = alpha_k-weighted means of the round's uploads; they become
    `client/global` and the cut's head in `aux/global` (what a client that never took part
    gets). Each participant's personal blobs become `lam * upload + (1 - lam) * mean`. A
    client with personal blobs that was not sampled this round trained nothing; it is mixed
    the same way from its stored blobs (as if it had taken zero local steps), so it follows
    the shared model as the paper's rule, applied to every client, would have it.
    """
    if not updates:
        raise ValueError("no client updates to aggregate")
    alphas = [u.samples for u in updates]
    phi_bar = weighted_average([u.client_weights for u in updates], alphas)
    h_bar = weighted_average([u.aux_weights for u in updates], alphas)
    out: VersionWeights = dict(previous)
    out[CLIENT] = phi_bar
    out[AUX] = {**previous.get(AUX, {}), **h_bar}
    uploaded = {u.client: u for u in updates}
    owners = {ref.owner for ref in previous if ref.part == CLIENT_PART and ref != CLIENT}
    for owner in sorted(owners | set(uploaded)):
        update = uploaded.get(owner)
        if update is not None:
            own_phi, own_h = update.client_weights, update.aux_weights
        else:
            own_phi = previous[BlobRef(CLIENT_PART, owner)]
            own_h = previous.get(BlobRef(AUX_PART, owner), h_bar)
        out[BlobRef(CLIENT_PART, owner)] = mix(own_phi, phi_bar, lam)
        out[BlobRef(AUX_PART, owner)] = mix(own_h, h_bar, lam)
    return out


@dataclass(frozen=True)
class SplitGP:
    gamma: float = 0.5
    lam: float = 0.2
    entropy_threshold: float = 0.5
    sweep: tuple[float, ...] = SWEEP_THRESHOLDS
    name: str = "splitgp"
    splits: bool = True
    waits_for_gradient: bool = True
    server_barrier: bool = False
    # Workers answer InferRequests with theta (`workers.inference`).
    split_inference: bool = True

    @classmethod
    def from_params(cls, params: Mapping[str, ConfigValue]) -> SplitGP:
        section = SplitGPSection.model_validate(dict(params))
        return cls(
            gamma=section.gamma, lam=section.lam, entropy_threshold=section.entropy_threshold
        )

    def initial_weights(self, model: SplitNet, cut: str) -> VersionWeights:
        return split_initial_weights(model, cut)

    def client_round(
        self,
        model: SplitNet,
        cut: str,
        batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
        steps: int,
        channel: SmashedChannel,
        hyper: Hyper,
        context: ClientContext,
    ) -> RoundResult:
        body, head = model.client_blocks(cut), model.head(cut)
        body.train()
        head.train()
        optimizer = hyper.client_optimizer([*body.parameters(), *head.parameters()])
        samples = correct = 0
        loss_sum = 0.0
        for step, (x, y) in enumerate(batches):
            z = body(x)
            head_logits = head(z)
            grad = channel.exchange(z.detach(), y, step, steps)
            objective = client_objective(head_logits, y, z, grad, self.gamma)
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
            rows = int(y.shape[0])
            with torch.no_grad():
                loss_sum += float(nn.functional.cross_entropy(head_logits, y)) * rows
                correct += int((head_logits.argmax(dim=1) == y).sum())
            samples += rows
        metrics = {"train_samples": float(samples)}
        if samples:
            metrics.update(
                head_train_loss=loss_sum / samples, head_train_accuracy=correct / samples
            )
        return RoundResult(
            client_state(model, cut), aux_weights=head_state(model, [cut]), metrics=metrics
        )

    def server_step(
        self, server: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[CohortBatch]
    ) -> list[tuple[torch.Tensor, float, int]]:
        r = scaled_server_step(
            server,
            optimizer,
            [b.activations for b in batches],
            [b.labels for b in batches],
            1.0 - self.gamma,
        )
        return list(zip(r.grads, r.losses, r.correct, strict=True))

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        out = personalise(previous, updates, self.lam)
        trained = [r for r in replicas if r.samples > 0]
        if trained:
            out[SERVER] = weighted_average(
                [r.weights for r in trained], [r.samples for r in trained]
            )
        return out

    def personal_metrics(
        self,
        model: SplitNet,
        blobs: VersionWeights,
        x: torch.Tensor,
        y: torch.Tensor,
        clients: Mapping[str, Sequence[int]],
    ) -> dict[str, float]:
        return version_metrics(
            model, blobs, x, y, clients, threshold=self.entropy_threshold, sweep=self.sweep
        )
