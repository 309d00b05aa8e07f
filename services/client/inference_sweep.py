"""The E_th sweep of split inference over a published version, client by client: each
personalised client's `phi_k`, `h_k` and theta on its `local` and `global` test rows
(docs/algorithms.md, SplitGP, "Sweep of a service run").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from broker.store import AUX_PART, CLIENT_PART, GLOBAL_OWNER, SERVER_PART, BlobRef, WeightStore
from models.state import load_partial
from services.algorithms.splitgp import SweepPoint
from services.client.data import JobData
from services.client.inference import ServerLogits, SplitPredictor, entropy_sweep
from services.common.jobmodel import job_model
from services.config.root import Settings

_SIMULATED = re.compile(r"client-(\d+)\Z")  # how `splitmq run` / `up` name partition i's client


@dataclass(frozen=True, kw_only=True)
class SweepRow(SweepPoint):
    client: str
    rows_set: str  # "local" (the client's classes) or "global" (every row)


def personal_clients(store: WeightStore, job: str, version: int) -> list[str]:
    """Clients with personalised blobs in `version`, in a natural order (client-2 < client-10)."""
    owners = {
        ref.owner
        for ref in store.manifest(job, version).entries
        if ref.part == CLIENT_PART and ref.owner != GLOBAL_OWNER
    }

    def key(owner: str) -> tuple[int, str]:
        match = _SIMULATED.match(owner)
        return (int(match.group(1)) if match else 1 << 30, owner)

    return sorted(owners, key=key)


def partition_of(client: str, data: JobData) -> int | None:
    """The data partition of a simulated client (`client-<i>`), if it is one of this job's."""
    match = _SIMULATED.match(client)
    if match is None:
        return None
    index = int(match.group(1))
    return index if index < data.clients else None


def sweep_clients(
    settings: Settings,
    store: WeightStore,
    data: JobData,
    theta: ServerLogits,
    *,
    version: int,
    thresholds: Sequence[float],
    clients: Sequence[str],
    rows: int,
) -> list[SweepRow]:
    job, cut = settings.job.name, settings.model.cut
    test = data.dataset.test
    count = min(rows, len(test.y)) if rows else len(test.y)
    x, y = test.x[:count], test.y[:count]
    shared = {
        part: store.read_blob(job, version, BlobRef(part)) for part in (AUX_PART, SERVER_PART)
    }
    out: list[SweepRow] = []
    for client in clients:
        model = job_model(settings)
        for blob in shared.values():
            load_partial(model, blob)
        for part in (CLIENT_PART, AUX_PART):
            load_partial(model, store.read_blob(job, version, BlobRef(part, client)))
        predictor = SplitPredictor(model, cut, theta, threshold=0.0)
        sets = {"global": torch.ones_like(y, dtype=torch.bool)}
        index = partition_of(client, data)
        if index is not None:
            sets["local"] = torch.isin(y, torch.tensor(data.classes(index), dtype=y.dtype))
        for name, where in sets.items():
            if not bool(where.any()):
                continue
            points = entropy_sweep(predictor, x[where], y[where], thresholds)
            out += [SweepRow(**vars(p), client=client, rows_set=name) for p in points]
    return out


def mean_rows(rows: Sequence[SweepRow]) -> list[tuple[float, str, float, float, int]]:
    """(threshold, set, mean accuracy, mean offloaded fraction, clients) over the clients."""
    groups: dict[tuple[float, str], list[SweepRow]] = {}
    for row in rows:
        groups.setdefault((row.threshold, row.rows_set), []).append(row)
    return [
        (
            threshold,
            rows_set,
            sum(r.accuracy for r in group) / len(group),
            sum(r.offloaded for r in group) / len(group),
            len(group),
        )
        for (threshold, rows_set), group in sorted(groups.items())
    ]
