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

Per-version evaluation (`version_metrics`): each client's personalised model (`phi_k`, `h_k`,
the shared `theta`) as its head alone, as `theta(phi_k(x))` and by split inference, on its
local, out-of-distribution and whole test rows; docs/algorithms.md "Reported per version"
lists the metrics (accuracy at an out-of-distribution fraction p: `(1 - p) * local + p * ood`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from types import MappingProxyType
from typing import Self

import torch
from pydantic import Field
from torch.nn import functional as F

from broker.store import AUX_PART, CLIENT_PART, BlobRef
from models.split import SplitNet, evaluating
from models.state import client_state, head_state, load_partial
from services.algorithms.averaging import weighted_average
from services.algorithms.base import (
    AUX,
    CLIENT,
    ClientUpdate,
    LocalRound,
    Params,
    RoundResult,
    ServerSide,
    ShardReplica,
    State,
    StrategyBase,
    Traits,
    VersionWeights,
    algorithm,
    average_replicas,
    full_model_weights,
)
from services.algorithms.recipe import LossFn, cross_entropy
from services.algorithms.sfl import SFLServer


class SplitGPSection(Params):
    # Weight of the client head's loss in F_k = gamma*l(phi,h) + (1-gamma)*l(phi,theta).
    gamma: float = Field(default=0.5, ge=0, le=1)
    # Personalisation: phi_k <- lam*phi_k + (1-lam)*mean_i phi_i (lam=0: multi-exit, shared).
    lam: float = Field(default=0.2, ge=0, le=1)
    # Split inference: predict at the client when the entropy of its head's softmax <= this.
    entropy_threshold: float = Field(default=0.5, ge=0)


# --- training -----------------------------------------------------------------------------------


def client_objective(
    head_logits: torch.Tensor,
    labels: torch.Tensor,
    z: torch.Tensor,
    server_grad: torch.Tensor,
    gamma: float,
    loss: LossFn = cross_entropy,
) -> torch.Tensor:
    """A scalar whose gradient w.r.t. the client's parameters is `grad F_k`.

    `server_grad` is what the worker returned: `(1 - gamma) * dl_S/dz`, already scaled, so the
    server's part enters as the surrogate `<z, server_grad>` (its gradient w.r.t. z is exactly
    `server_grad`), and the head's part as `gamma * l(h(z), y)`.
    """
    head_loss = loss(head_logits, labels)
    surrogate = (z * server_grad.to(device=z.device, dtype=z.dtype)).sum()
    return gamma * head_loss + surrogate


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


# --- evaluation -------------------------------------------------------------------------------

# E_th of the sweep reported with every version (nats; log 10 = 2.30 is the most a 10-class
# softmax can have, so the last one keeps nearly everything on the client).
SWEEP_THRESHOLDS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
CHUNK = 512


def cut_of(model: SplitNet, client_state: Mapping[str, torch.Tensor]) -> str:
    """The cut a client-side state ends at (the last block it holds)."""
    indices = {int(name.split(".")[1]) for name in client_state if name.startswith("blocks.")}
    if not indices:
        raise ValueError("the client-side state holds no block")
    cut = model.block_names[max(indices)]
    model.cut_index(cut)  # raises when that block is not a cut
    return cut


@dataclass(frozen=True)
class RowResults:
    """Per test row, for one client's model: head entropy, and whether each answer is right."""

    entropy: torch.Tensor
    head_correct: torch.Tensor
    theta_correct: torch.Tensor

    def split(self, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Split inference at `threshold`: which rows stay local, and which are answered right."""
        kept = stays_local(self.entropy, threshold)
        return kept, torch.where(kept, self.head_correct, self.theta_correct)


def head_pass(model: SplitNet, cut: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(z, head logits) of the client side of `model` at `cut`, in eval mode."""
    body, head = model.client_blocks(cut), model.head(cut)
    with evaluating([body, head]):
        z = body(x)
        return z, head(z)


def row_results(
    model: SplitNet,
    cut: str,
    server: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    asked_above: float = -math.inf,
    chunk: int = CHUNK,
) -> RowResults:
    """Run `model` (already holding the client's weights) over (x, y) in eval mode; `server`
    (theta's logits) answers only the rows whose entropy is above `asked_above`, once each
    (the others count as wrong: every threshold from `asked_above` on keeps them local)."""
    entropies, head_hits, theta_hits = [], [], []
    for start in range(0, len(y), chunk):
        xs, ys = x[start : start + chunk], y[start : start + chunk]
        z, head_logits = head_pass(model, cut, xs)
        e = entropy(head_logits)
        asked = ~stays_local(e, asked_above)
        hits = torch.zeros_like(ys, dtype=torch.bool)
        if bool(asked.any()):
            hits[asked] = server(z[asked]).argmax(dim=1).to(ys.device) == ys[asked]
        entropies.append(e)
        head_hits.append(head_logits.argmax(dim=1) == ys)
        theta_hits.append(hits)
    return RowResults(torch.cat(entropies), torch.cat(head_hits), torch.cat(theta_hits))


def rate(flags: torch.Tensor, rows: torch.Tensor) -> float:
    n = int(rows.sum())
    return float(flags[rows].sum()) / n if n else float("nan")


@dataclass(frozen=True)
class SweepPoint:
    """Split inference at one threshold: accuracy and the fraction of rows sent to the server."""

    threshold: float
    accuracy: float
    offloaded: float
    rows: int


def sweep(results: RowResults, thresholds: Sequence[float]) -> list[SweepPoint]:
    """Split inference over every row at each threshold."""
    every = torch.ones_like(results.entropy, dtype=torch.bool)
    points = []
    for threshold in thresholds:
        kept, correct = results.split(threshold)
        points.append(
            SweepPoint(float(threshold), rate(correct, every), rate(~kept, every), len(every))
        )
    return points


def own_rows(y: torch.Tensor, classes: Sequence[int]) -> torch.Tensor:
    """The rows of `y` in `classes`; all of them without classes (its own distribution)."""
    if not classes:
        return torch.ones_like(y, dtype=torch.bool)
    return torch.isin(y, torch.tensor(sorted(set(classes)), dtype=y.dtype))


def client_metrics(
    results: RowResults,
    y: torch.Tensor,
    classes: Sequence[int],
    threshold: float,
    sweep: Sequence[float],
) -> dict[str, float]:
    """One client's metrics (names without the `splitgp.` prefix)."""
    local = own_rows(y, classes)
    rows = {"local": local, "ood": ~local, "global": torch.ones_like(local)}
    out: dict[str, float] = {}
    for name, where in rows.items():
        out[f"head_{name}"] = rate(results.head_correct, where)
        out[f"theta_{name}"] = rate(results.theta_correct, where)
    for prefix, th in [("", threshold), *((f"sweep.{t:g}.", t) for t in sweep)]:
        kept, correct = results.split(th)
        for name, where in rows.items():
            out[f"{prefix}split_{name}"] = rate(correct, where)
            out[f"{prefix}offload_{name}"] = rate(~kept, where)
    return out


def version_metrics(
    model: SplitNet,
    blobs: VersionWeights,
    x: torch.Tensor,
    y: torch.Tensor,
    clients: Mapping[str, Sequence[int]],
    *,
    threshold: float,
    sweep: Sequence[float] = SWEEP_THRESHOLDS,
) -> dict[str, float]:
    """Means over `clients` (id -> classes) of every client's metrics, as `splitgp.<name>`.

    `model` is a scratch model: it is left holding the last client's weights. A metric no
    client has (e.g. `*_ood` when every client holds every class) is left out.
    """
    if not clients or CLIENT not in blobs:
        return {}
    cut = cut_of(model, blobs[CLIENT])
    values: dict[str, list[float]] = {}
    for client, classes in sorted(clients.items()):
        load_partial(model, full_model_weights(blobs, client))
        with evaluating([model]):
            results = row_results(model, cut, model.server_blocks(cut), x, y)
        for name, value in client_metrics(results, y, classes, threshold, sweep).items():
            if value == value:  # NaN: the client has no such rows
                values.setdefault(name, []).append(value)
    return {f"splitgp.{name}": sum(seen) / len(seen) for name, seen in values.items()}


# --- the algorithm --------------------------------------------------------------------------------


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


@algorithm("splitgp", params=SplitGPSection)
class SplitGP(StrategyBase):
    gamma: float = 0.5
    lam: float = 0.2
    entropy_threshold: float = 0.5
    sweep: tuple[float, ...] = SWEEP_THRESHOLDS
    name: str = "splitgp"
    # `personal_metrics` per test-row kind: local classes, out of distribution, all.
    traits = Traits(
        uses_heads=True,
        report_plots=MappingProxyType(
            {
                "split inference accuracy": ("splitgp.split_*",),
                "client head alone": ("splitgp.head_*",),
                "rows offloaded to the server": ("splitgp.offload_*",),
            }
        ),
    )

    @cached_property
    def server(self) -> ServerSide | None:
        # Eq. (8): `theta <- theta - eta * (1-gamma) * grad l_S`, and each batch's
        # `(1-gamma) * dl_S/dz` for its client; folded batches as in SFL's fold. Workers
        # answer InferRequests with theta (`workers.inference`).
        return SFLServer(loss_scale=1.0 - self.gamma, split_inference=True)

    @classmethod
    def create(cls, name: str, params: Params | None) -> Self:
        assert isinstance(params, SplitGPSection)
        return cls(gamma=params.gamma, lam=params.lam, entropy_threshold=params.entropy_threshold)

    def client_round(self, r: LocalRound) -> RoundResult:
        model, cut = r.model, r.cut
        body, head = model.client_blocks(cut), model.head(cut)
        body.train()
        head.train()
        optimizer = r.hyper.client_optimizer([*body.parameters(), *head.parameters()])
        samples = correct = 0
        loss_sum = 0.0
        for step, (x, y) in enumerate(r.batches):
            z = body(x)
            head_logits = head(z)  # the head is the client's own: it sees z undefended
            smashed = self.smashed(r, x, z, step)
            grad = r.channel.exchange(smashed.wire(), y, step, r.steps)
            objective = smashed.with_penalty(
                client_objective(head_logits, y, smashed.sent, grad, self.gamma, r.hyper.loss)
            )
            optimizer.zero_grad(set_to_none=True)
            objective.backward()
            optimizer.step()
            rows = int(y.shape[0])
            with torch.no_grad():
                loss_sum += float(r.hyper.loss(head_logits, y)) * rows
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

    def aggregate(
        self,
        previous: VersionWeights,
        updates: Sequence[ClientUpdate],
        replicas: Sequence[ShardReplica],
    ) -> VersionWeights:
        return average_replicas(personalise(previous, updates, self.lam), replicas)

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
