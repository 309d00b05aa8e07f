"""SplitGP's per-version evaluation: every client's personalised model, three ways.

For each client k (its `phi_k`, `h_k` from the version's personal blobs, else the global ones,
and the shared `theta`), on the test split:
- `head`: `h_k(phi_k(x))`, the model it runs alone;
- `theta`: `theta(phi_k(x))`, the full model with its own client side;
- `split`: split inference, the head's answer when its entropy is <= E_th, else theta's;
each on the client's local test set (`local`: the test samples of its classes), the others
(`ood`: out of distribution) and the whole split (`global`), with the fraction of rows sent
to the server (`offload_*`). Accuracy at an out-of-distribution fraction p is then
`(1 - p) * local + p * ood`. Means over clients are reported as `splitgp.<metric>`, and
split inference at each threshold of a sweep as `splitgp.sweep.<E_th>.<metric>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from broker.store import AUX_PART, CLIENT_PART, SERVER_PART, BlobRef
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import VersionWeights
from services.algorithms.splitgp_math import entropy, stays_local

# E_th of the sweep reported with every version (nats; log 10 = 2.30 is the most a 10-class
# softmax can have, so the last one keeps nearly everything on the client).
SWEEP_THRESHOLDS = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)
SETS = ("local", "ood", "global")
CHUNK = 512


def cut_of(model: SplitNet, client_state: Mapping[str, torch.Tensor]) -> str:
    """The cut a client-side state ends at (the last block it holds)."""
    indices = {int(name.split(".")[1]) for name in client_state if name.startswith("blocks.")}
    if not indices:
        raise ValueError("the client-side state holds no block")
    cut = model.block_names[max(indices)]
    model.cut_index(cut)  # raises when that block is not a cut
    return cut


def client_weights(blobs: VersionWeights, client: str) -> dict[str, torch.Tensor]:
    """The whole model as client `client` holds it: global blobs, its personal ones on top."""
    merged: dict[str, torch.Tensor] = {}
    for part in (AUX_PART, SERVER_PART, CLIENT_PART):
        merged.update(blobs.get(BlobRef(part), {}))
        merged.update(blobs.get(BlobRef(part, client), {}))
    return merged


@dataclass(frozen=True)
class RowResults:
    """Per test row, for one client's model: head entropy, and whether each answer is right."""

    entropy: torch.Tensor
    head_correct: torch.Tensor
    theta_correct: torch.Tensor


def row_results(model: SplitNet, cut: str, x: torch.Tensor, y: torch.Tensor) -> RowResults:
    """Run `model` (already holding the client's weights) over (x, y) in eval mode."""
    body, head, server = model.client_blocks(cut), model.head(cut), model.server_blocks(cut)
    was_training = model.training
    model.eval()
    entropies, head_hits, theta_hits = [], [], []
    with torch.no_grad():
        for start in range(0, len(y), CHUNK):
            xs, ys = x[start : start + CHUNK], y[start : start + CHUNK]
            z = body(xs)
            head_logits = head(z)
            entropies.append(entropy(head_logits))
            head_hits.append(head_logits.argmax(dim=1) == ys)
            theta_hits.append(server(z).argmax(dim=1) == ys)
    model.train(was_training)
    return RowResults(torch.cat(entropies), torch.cat(head_hits), torch.cat(theta_hits))


def _rate(flags: torch.Tensor, rows: torch.Tensor) -> float:
    n = int(rows.sum())
    return float(flags[rows].sum()) / n if n else float("nan")


def client_metrics(
    results: RowResults,
    y: torch.Tensor,
    classes: Sequence[int],
    threshold: float,
    sweep: Sequence[float],
) -> dict[str, float]:
    """One client's metrics (names without the `splitgp.` prefix)."""
    if classes:
        local = torch.isin(y, torch.tensor(sorted(set(classes)), dtype=y.dtype))
    else:  # no classes reported: every test row is its own distribution
        local = torch.ones_like(y, dtype=torch.bool)
    rows = {"local": local, "ood": ~local, "global": torch.ones_like(local)}
    out: dict[str, float] = {}
    for name, where in rows.items():
        out[f"head_{name}"] = _rate(results.head_correct, where)
        out[f"theta_{name}"] = _rate(results.theta_correct, where)
    for prefix, th in [("", threshold), *((f"sweep.{t:g}.", t) for t in sweep)]:
        kept = stays_local(results.entropy, th)
        correct = torch.where(kept, results.head_correct, results.theta_correct)
        for name, where in rows.items():
            out[f"{prefix}split_{name}"] = _rate(correct, where)
            out[f"{prefix}offload_{name}"] = _rate(~kept, where)
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
    if not clients or BlobRef(CLIENT_PART) not in blobs:
        return {}
    cut = cut_of(model, blobs[BlobRef(CLIENT_PART)])
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for client, classes in sorted(clients.items()):
        load_partial(model, client_weights(blobs, client))
        metrics = client_metrics(row_results(model, cut, x, y), y, classes, threshold, sweep)
        for name, value in metrics.items():
            if value == value:  # NaN: the client has no such rows
                sums[name] = sums.get(name, 0.0) + value
                counts[name] = counts.get(name, 0) + 1
    return {f"splitgp.{name}": sums[name] / counts[name] for name in sums}
