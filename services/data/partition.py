"""Split a labelled training set among clients: pure functions over the label array.

Every partitioner returns one sorted int64 index array per client; no index appears in two
clients. All randomness comes from ``seed`` (an int, or a ``numpy.random.Generator`` the caller
owns), so the same labels, parameters and seed always give the same partition.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import numpy.typing as npt

from services.data.errors import PartitionError

Indices = npt.NDArray[np.int64]
Seed = int | np.random.Generator
PartitionKind = Literal["iid", "dirichlet", "shards", "label_ratio"]


def _rng(seed: Seed) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _labels(labels: npt.ArrayLike) -> npt.NDArray[np.int64]:
    array = np.asarray(labels)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise PartitionError(f"labels must be a 1-D integer array, got {array.dtype} {array.shape}")
    return array.astype(np.int64, copy=False)


def _check_clients(n_clients: int, n_samples: int) -> None:
    if n_clients < 1:
        raise PartitionError(f"n_clients must be >= 1, got {n_clients}")
    if n_clients > n_samples:
        raise PartitionError(f"{n_clients} clients but only {n_samples} samples")


def _sorted(parts: Sequence[npt.NDArray[np.integer]]) -> list[Indices]:
    return [np.sort(p).astype(np.int64) for p in parts]


def iid(labels: npt.ArrayLike, n_clients: int, *, seed: Seed = 0) -> list[Indices]:
    """Uniformly random split into ``n_clients`` parts whose sizes differ by at most one."""
    y = _labels(labels)
    _check_clients(n_clients, len(y))
    return _sorted(np.array_split(_rng(seed).permutation(len(y)), n_clients))


def dirichlet(
    labels: npt.ArrayLike,
    n_clients: int,
    alpha: float,
    *,
    min_size: int = 10,
    seed: Seed = 0,
    max_tries: int = 200,
) -> list[Indices]:
    """Label skew by a per-class Dirichlet(alpha) draw over clients (Hsu et al. 2019).

    The variant of NIID-Bench (Li et al. 2022): each class is split among clients by
    proportions ~ Dir(alpha), except that a client already holding its fair share N/K gets no
    more; the whole draw is repeated until every client holds at least ``min_size`` samples.
    Small alpha concentrates each class on a few clients; large alpha approaches IID.
    """
    y = _labels(labels)
    _check_clients(n_clients, len(y))
    if not alpha > 0:
        raise PartitionError(f"alpha must be > 0, got {alpha}")
    if min_size < 0 or min_size * n_clients > len(y):
        raise PartitionError(
            f"min_size={min_size} for {n_clients} clients needs {min_size * n_clients} samples, "
            f"have {len(y)}"
        )
    rng = _rng(seed)
    fair_share = len(y) / n_clients
    by_class = [np.flatnonzero(y == c) for c in np.unique(y)]
    for _ in range(max_tries):
        parts: list[list[npt.NDArray[np.intp]]] = [[] for _ in range(n_clients)]
        sizes = np.zeros(n_clients, dtype=np.int64)
        for members in by_class:
            shuffled = rng.permutation(members)
            p = rng.dirichlet(np.full(n_clients, alpha))
            p = p * (sizes < fair_share)
            total = p.sum()
            # Every client can be at its fair share only when the classes are exhausted; fall
            # back to the unmasked draw rather than dividing by zero.
            p = p / total if total > 0 else rng.dirichlet(np.full(n_clients, alpha))
            cuts = (np.cumsum(p)[:-1] * len(shuffled)).astype(np.int64)
            for client, chunk in enumerate(np.split(shuffled, cuts)):
                parts[client].append(chunk)
                sizes[client] += len(chunk)
        if sizes.min() >= min_size:
            return _sorted([np.concatenate(chunks) for chunks in parts])
    raise PartitionError(
        f"dirichlet(alpha={alpha}) gave some client fewer than min_size={min_size} samples in "
        f"{max_tries} draws; lower min_size, raise alpha or use fewer clients"
    )


def _deal_distinct(
    deal: npt.NDArray[np.int64], shard_labels: npt.NDArray[np.int64], rng: np.random.Generator
) -> None:
    """Swap shards between clients, in place, until no client holds two of one label.

    A plain random deal of 2 label-pure shards to each of 100 clients repeats a label for
    ~10% of them; the setup this models means "2 classes per client". A swap is kept only when
    it lowers the number of repeated labels; a bounded number of tries leaves some repeats only
    when the label counts make distinct labels impossible (or nearly so).
    """
    n_clients, per_client = int(deal.shape[0]), int(deal.shape[1])

    def repeats(row: npt.NDArray[np.int64]) -> int:
        return per_client - int(np.unique(shard_labels[row]).size)

    rep = np.array([repeats(row) for row in deal], dtype=np.int64)
    for _ in range(200 * deal.size):
        bad = np.flatnonzero(rep)
        if len(bad) == 0:
            return
        a = int(bad[rng.integers(len(bad))])
        b = int(rng.integers(n_clients))
        if a == b:
            continue
        i, j = int(rng.integers(per_client)), int(rng.integers(per_client))
        deal[a, i], deal[b, j] = deal[b, j], deal[a, i]
        after_a, after_b = repeats(deal[a]), repeats(deal[b])
        if after_a + after_b < rep[a] + rep[b]:
            rep[a], rep[b] = after_a, after_b
        else:
            deal[a, i], deal[b, j] = deal[b, j], deal[a, i]


def shards(
    labels: npt.ArrayLike,
    n_clients: int,
    *,
    shards_per_client: int = 2,
    shard_size: int = 250,
    distinct: bool = True,
    seed: Seed = 0,
) -> list[Indices]:
    """Pathological non-IID split of McMahan et al., as in Sub-FedAvg and SplitGP.

    Sort the samples by label, cut them into ``len(labels) // shard_size`` contiguous shards
    and deal ``shards_per_client`` random shards to each client (unused shards are left out).
    With ``distinct`` a client never receives two shards of the same (majority) label when the
    label counts allow it, so label-pure shards give exactly ``shards_per_client`` classes.
    """
    y = _labels(labels)
    if n_clients < 1 or shards_per_client < 1 or shard_size < 1:
        raise PartitionError("n_clients, shards_per_client and shard_size must all be >= 1")
    needed = n_clients * shards_per_client
    available = len(y) // shard_size
    if needed > available:
        raise PartitionError(
            f"{n_clients} clients x {shards_per_client} shards of {shard_size} need "
            f"{needed * shard_size} samples, have {len(y)} ({available} shards)"
        )
    rng = _rng(seed)
    # Stable sort: within a label, shards follow the dataset order, so a shard is the same
    # set of samples whatever the seed; only the deal is random.
    order = np.argsort(y, kind="stable")[: available * shard_size].reshape(available, shard_size)
    shard_labels = np.array([np.bincount(y[s]).argmax() for s in order], dtype=np.int64)
    deal = rng.choice(available, size=(n_clients, shards_per_client), replace=False)
    deal = deal.astype(np.int64)
    if distinct and shards_per_client > 1:
        _deal_distinct(deal, shard_labels, rng)
    return _sorted([order[row].ravel() for row in deal])


def label_ratio(
    labels: npt.ArrayLike, n_clients: int, r: float, *, seed: Seed = 0
) -> list[Indices]:
    """MiniBatch-SFL's non-IID split with ratio ``r`` (Huang, Tian, Tang).

    A random ``1 - r`` fraction of the samples is spread uniformly at random over the clients;
    the remaining ``r`` fraction is sorted by label and cut into ``n_clients`` equal contiguous
    blocks, block k going to client k. ``r = 0`` is IID; ``r = 1`` gives each client one or
    two labels.
    """
    y = _labels(labels)
    _check_clients(n_clients, len(y))
    if not 0.0 <= r <= 1.0:
        raise PartitionError(f"r must be in [0, 1], got {r}")
    perm = _rng(seed).permutation(len(y))
    n_skewed = round(r * len(y))
    spread, skewed = perm[: len(y) - n_skewed], perm[len(y) - n_skewed :]
    skewed = skewed[np.argsort(y[skewed], kind="stable")]
    uniform_parts = np.array_split(spread, n_clients)
    block_parts = np.array_split(skewed, n_clients)
    return _sorted([np.concatenate(pair) for pair in zip(uniform_parts, block_parts, strict=True)])


def partition(
    labels: npt.ArrayLike,
    kind: PartitionKind,
    n_clients: int,
    *,
    seed: int = 0,
    alpha: float = 0.5,
    min_size: int = 10,
    shards_per_client: int = 2,
    shard_size: int = 250,
    distinct_shards: bool = True,
    ratio: float = 0.0,
) -> list[Indices]:
    """The `kind` partitioner's split. Parameters a kind does not use are ignored:
    ``alpha``/``min_size`` (dirichlet), ``shards_per_client``/``shard_size``/``distinct_shards``
    (shards), ``ratio`` (label_ratio)."""
    if seed < 0:
        raise PartitionError(f"seed must be >= 0, got {seed}")
    if kind == "iid":
        return iid(labels, n_clients, seed=seed)
    if kind == "dirichlet":
        return dirichlet(labels, n_clients, alpha, min_size=min_size, seed=seed)
    if kind == "shards":
        return shards(
            labels,
            n_clients,
            shards_per_client=shards_per_client,
            shard_size=shard_size,
            distinct=distinct_shards,
            seed=seed,
        )
    if kind == "label_ratio":
        return label_ratio(labels, n_clients, ratio, seed=seed)
    raise PartitionError(
        f"unknown partition kind {kind!r}; known: iid, dirichlet, shards, label_ratio"
    )


def client_classes(labels: npt.ArrayLike, indices: npt.ArrayLike) -> npt.NDArray[np.int64]:
    """The sorted distinct labels among ``labels[indices]``."""
    return np.unique(_labels(labels)[np.asarray(indices, dtype=np.int64)])


def local_test_indices(test_labels: npt.ArrayLike, client_train_labels: npt.ArrayLike) -> Indices:
    """Indices of the test samples whose class occurs in a client's training labels.

    This is the personalised test set: a client is evaluated on the classes it trained on.
    """
    seen = np.unique(_labels(client_train_labels))
    return np.flatnonzero(np.isin(_labels(test_labels), seen)).astype(np.int64)
