"""Every client's model in a version, on its own classes and on the others (for `final_eval`).

The aggregator evaluates personalised models for the round's cohort only; the papers report
the mean over all clients. These functions take a version's blobs and evaluate, for each
client k of the job (`client-<k>`, the embedded runner's ids, data partition k), the model
k holds: its personal blobs over the global ones (`full_model_weights`), or the global model
when it has none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import VersionWeights, full_model_weights
from services.algorithms.splitgp import own_rows, rate
from services.client.data import JobData
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Dataset
from services.experiments.results import mean

CHUNK = 512


def client_id(index: int) -> str:
    """The id the embedded runner gives the client of data partition `index`."""
    return f"client-{index}"


def has_own(blobs: VersionWeights, client: str) -> bool:
    """Whether the version holds personal blobs of `client`."""
    return any(ref.owner == client for ref in blobs)


def all_clients(settings: Settings, dataset: Dataset) -> dict[str, list[int]]:
    """Every client of the job (id → the classes of its training data)."""
    data = JobData(settings, dataset)
    return {client_id(k): data.classes(k) for k in range(data.clients)}


def predictions(
    model: SplitNet, weights: Mapping[str, torch.Tensor], x: torch.Tensor
) -> torch.Tensor:
    """The whole model's predicted class per row of `x`, holding `weights` (eval mode)."""
    load_partial(model, weights)
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(x), CHUNK):
            out.append(model(x[start : start + CHUNK]).argmax(dim=1))
    return torch.cat(out) if out else torch.empty(0, dtype=torch.int64)


def client_hits(
    model: SplitNet,
    blobs: VersionWeights,
    x: torch.Tensor,
    y: torch.Tensor,
    rows: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Per client, whether the model it holds is right on each of its `rows` of (x, y): its
    own where the version has personal blobs of it, else the global model, which is evaluated
    once on the rows of every client that needs it."""
    shared = torch.zeros(len(y), dtype=torch.bool)
    needed = [r for c, r in rows.items() if not has_own(blobs, c)]
    if needed:
        union = torch.unique(torch.cat(needed))
        shared[union] = predictions(model, full_model_weights(blobs), x[union]) == y[union]
    return {
        client: predictions(model, full_model_weights(blobs, client), x[r]) == y[r]
        if has_own(blobs, client)
        else shared[r]
        for client, r in rows.items()
    }


def local_and_ood(
    model: SplitNet,
    blobs: VersionWeights,
    x: torch.Tensor,
    y: torch.Tensor,
    clients: Mapping[str, Sequence[int]],
) -> dict[str, float]:
    """Per client, its whole model's accuracy on the rows of its classes (`local.<id>`) and on
    the other rows (`ood.<id>`); their means over clients as `full_local`, `full_ood`."""
    every = torch.arange(len(y))
    hits = client_hits(model, blobs, x, y, {client: every for client in clients})
    out: dict[str, float] = {}
    for client, classes in sorted(clients.items()):
        local = own_rows(y, classes)
        out[f"local.{client}"] = rate(hits[client], local)
        out[f"ood.{client}"] = rate(hits[client], ~local)
    for name in ("local", "ood"):
        out[f"full_{name}"] = mean(out[f"{name}.{client}"] for client in clients)
    return out


def local_test_accuracy(
    settings: Settings, dataset: Dataset, blobs: VersionWeights
) -> dict[str, float]:
    """Each client's model on its local test set exactly as the client measures it itself
    (`JobData.local_test`: the test rows of its classes, capped at `data.eval_samples`), as
    `local.<id>`, with `own.<id>` = 1 when the model is the client's own (personal blobs) and 0
    when it is the global one."""
    data = JobData(settings, dataset)
    rows = {client_id(k): torch.from_numpy(data.local_test(k)) for k in range(data.clients)}
    hits = client_hits(job_model(settings), blobs, dataset.test.x, dataset.test.y, rows)
    out: dict[str, float] = {}
    for client, right in hits.items():
        out[f"local.{client}"] = float(right.float().mean()) if len(right) else float("nan")
        out[f"own.{client}"] = 1.0 if has_own(blobs, client) else 0.0
    return out
