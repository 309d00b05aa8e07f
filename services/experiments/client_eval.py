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
from services.aggregator.evaluation import full_model_weights
from services.algorithms.base import VersionWeights
from services.client.data import JobData
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Dataset

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


def _rate(hits: torch.Tensor, rows: torch.Tensor) -> float:
    n = int(rows.sum())
    return float(hits[rows].sum()) / n if n else float("nan")


def local_rows(y: torch.Tensor, classes: Sequence[int]) -> torch.Tensor:
    """Rows of `y` among `classes` (every row when `classes` is empty)."""
    if not classes:
        return torch.ones_like(y, dtype=torch.bool)
    return torch.isin(y, torch.tensor(sorted(set(classes)), dtype=y.dtype))


def local_and_ood(
    model: SplitNet,
    blobs: VersionWeights,
    x: torch.Tensor,
    y: torch.Tensor,
    clients: Mapping[str, Sequence[int]],
) -> dict[str, float]:
    """Per client, its whole model's accuracy on the rows of its classes (`local.<id>`) and on
    the other rows (`ood.<id>`); their means over clients as `full_local`, `full_ood`.

    The global model is evaluated once for every client without personal blobs."""
    shared: torch.Tensor | None = None
    out: dict[str, float] = {}
    for client, classes in sorted(clients.items()):
        if has_own(blobs, client):
            hits = predictions(model, full_model_weights(blobs, client), x) == y
        else:
            if shared is None:
                shared = predictions(model, full_model_weights(blobs), x) == y
            hits = shared
        local = local_rows(y, classes)
        out[f"local.{client}"] = _rate(hits, local)
        out[f"ood.{client}"] = _rate(hits, ~local)
    for name, key in (("local", "full_local"), ("ood", "full_ood")):
        values = [v for k, v in out.items() if k.startswith(name + ".") and v == v]
        out[key] = sum(values) / len(values) if values else float("nan")
    return out


def local_test_accuracy(
    settings: Settings, dataset: Dataset, blobs: VersionWeights
) -> dict[str, float]:
    """Each client's model on its local test set exactly as the client measures it itself
    (`JobData.local_test`: the test rows of its classes, capped at `data.eval_samples`), as
    `local.<id>`, with `own.<id>` = 1 when the model is the client's own (personal blobs) and 0
    when it is the global one. The global model is evaluated once, on the rows the clients
    without their own model need."""
    data = JobData(settings, dataset)
    test = dataset.test
    model = job_model(settings)
    rows = {client_id(k): torch.from_numpy(data.local_test(k)) for k in range(data.clients)}
    shared_rows = [r for c, r in rows.items() if not has_own(blobs, c)]
    shared = torch.zeros(len(test), dtype=torch.bool)  # hits of the global model, by test row
    if shared_rows:
        needed = torch.unique(torch.cat(shared_rows))
        global_weights = full_model_weights(blobs)
        shared[needed] = predictions(model, global_weights, test.x[needed]) == test.y[needed]
    out: dict[str, float] = {}
    for client, picked in rows.items():
        own = has_own(blobs, client)
        if own:
            weights = full_model_weights(blobs, client)
            hits = predictions(model, weights, test.x[picked]) == test.y[picked]
        else:
            hits = shared[picked]
        out[f"local.{client}"] = float(hits.float().mean()) if len(picked) else float("nan")
        out[f"own.{client}"] = 1.0 if own else 0.0
    return out
