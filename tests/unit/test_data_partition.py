"""Partitioners: disjointness, sizes, determinism, skew, local test sets."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from services.data.errors import PartitionError
from services.data.partition import (
    PartitionKind,
    client_classes,
    dirichlet,
    iid,
    label_ratio,
    local_test_indices,
    partition,
    shards,
)


def label_counts(
    labels: npt.ArrayLike, parts: Sequence[npt.ArrayLike], num_classes: int
) -> npt.NDArray[np.int64]:
    """Per-client label histogram, shape [n_clients, num_classes]."""
    y = np.asarray(labels, dtype=np.int64)
    return np.stack(
        [np.bincount(y[np.asarray(p, dtype=np.int64)], minlength=num_classes) for p in parts]
    ).astype(np.int64)


Parts = list[npt.NDArray[np.int64]]


def balanced_labels(per_class: int, classes: int = 10, seed: int = 0) -> npt.NDArray[np.int64]:
    """Labels in random order (as a real dataset), ``per_class`` of each class."""
    rng = np.random.default_rng(seed)
    return rng.permutation(np.repeat(np.arange(classes), per_class)).astype(np.int64)


def assert_disjoint(parts: Sequence[npt.NDArray[np.int64]], n: int) -> npt.NDArray[np.int64]:
    """No index twice, none out of range; returns all used indices."""
    used = np.concatenate(parts)
    assert used.dtype == np.int64
    assert len(np.unique(used)) == len(used), "an index is used by two clients"
    assert used.min() >= 0 and used.max() < n
    for p in parts:
        assert np.all(np.diff(p) > 0), "client indices are returned sorted"
    return used


def mean_normalised_entropy(labels: npt.NDArray[np.int64], parts: Parts) -> float:
    """Mean over clients of the entropy of their label distribution, divided by log(classes)."""
    counts = label_counts(labels, parts, 10).astype(np.float64)
    p = counts / counts.sum(axis=1, keepdims=True)
    logs = np.log(np.where(p > 0, p, 1.0))
    return float((-(p * logs).sum(axis=1)).mean() / np.log(10))


PARTITIONERS: dict[str, Callable[[npt.NDArray[np.int64], int], Parts]] = {
    "iid": lambda y, s: iid(y, 10, seed=s),
    "dirichlet": lambda y, s: dirichlet(y, 10, 0.3, seed=s),
    "shards": lambda y, s: shards(y, 10, shards_per_client=2, shard_size=100, seed=s),
    "label_ratio": lambda y, s: label_ratio(y, 10, 0.8, seed=s),
}


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_deterministic_per_seed_and_disjoint(kind: str) -> None:
    y = balanced_labels(300)
    make = PARTITIONERS[kind]
    a, b, other = make(y, 7), make(y, 7), make(y, 8)
    assert len(a) == 10
    assert_disjoint(a, len(y))
    assert all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))
    assert not all(np.array_equal(p, q) for p, q in zip(a, other, strict=True))


def test_generator_argument_is_used_and_advanced() -> None:
    y = balanced_labels(100)
    rng = np.random.default_rng(3)
    first, second = iid(y, 4, seed=rng), iid(y, 4, seed=rng)
    assert not all(np.array_equal(p, q) for p, q in zip(first, second, strict=True))
    again = iid(y, 4, seed=np.random.default_rng(3))
    assert all(np.array_equal(p, q) for p, q in zip(first, again, strict=True))


def test_iid_sizes_and_coverage() -> None:
    y = balanced_labels(1003)
    parts = iid(y, 7, seed=0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    assert len(assert_disjoint(parts, len(y))) == len(y)
    assert mean_normalised_entropy(y, parts) > 0.97


def test_iid_rejects_bad_client_counts() -> None:
    with pytest.raises(PartitionError, match="n_clients must be >= 1"):
        iid(np.zeros(5, np.int64), 0)
    with pytest.raises(PartitionError, match="6 clients but only 5 samples"):
        iid(np.zeros(5, np.int64), 6)
    with pytest.raises(PartitionError, match="1-D integer"):
        iid(np.zeros(5, np.float32), 2)


# --- dirichlet -------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_skew_follows_alpha(seed: int) -> None:
    y = balanced_labels(1000)
    skewed = dirichlet(y, 10, 0.05, seed=seed)
    middle = dirichlet(y, 10, 0.5, seed=seed)
    uniform = dirichlet(y, 10, 100.0, seed=seed)
    entropies = [mean_normalised_entropy(y, p) for p in (skewed, middle, uniform)]
    assert entropies[0] < 0.5, entropies
    assert entropies[2] > 0.97, entropies
    assert entropies[0] < entropies[1] < entropies[2]
    for parts in (skewed, middle, uniform):
        assert len(assert_disjoint(parts, len(y))) == len(y), "dirichlet uses every sample"


def test_dirichlet_min_size_is_respected() -> None:
    y = balanced_labels(200)
    parts = dirichlet(y, 20, 0.1, min_size=25, seed=4)
    assert min(len(p) for p in parts) >= 25


def test_dirichlet_impossible_requests_fail_clearly() -> None:
    y = balanced_labels(10)
    with pytest.raises(PartitionError, match="needs 110 samples, have 100"):
        dirichlet(y, 11, 1.0, min_size=10)
    with pytest.raises(PartitionError, match="min_size=5 samples in 3 draws"):
        dirichlet(y, 20, 0.001, min_size=5, max_tries=3)
    with pytest.raises(PartitionError, match="alpha must be > 0"):
        dirichlet(y, 2, 0.0)


# --- shards ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_shards_splitgp_setup_gives_two_classes_each(seed: int) -> None:
    y = balanced_labels(5000)  # CIFAR-10 train: 200 label-pure shards of 250
    parts = shards(y, 100, shards_per_client=2, shard_size=250, seed=seed)
    assert len(assert_disjoint(parts, len(y))) == 50_000
    counts = label_counts(y, parts, 10)
    for row in counts:
        assert sorted(row[row > 0].tolist()) == [250, 250]


def test_shards_without_distinct_is_a_plain_random_deal() -> None:
    y = balanced_labels(5000)
    parts = shards(y, 100, seed=0, distinct=False)
    assert_disjoint(parts, len(y))
    classes = [len(client_classes(y, p)) for p in parts]
    assert set(classes) <= {1, 2}
    # A plain deal of 200 shards (20 per class) repeats a class for ~10% of clients.
    assert classes.count(1) > 0


def test_shards_leave_out_unused_shards_and_allow_impure_ones() -> None:
    y = balanced_labels(6100)  # 61000 samples: 244 shards, some straddle two classes
    parts = shards(y, 50, shards_per_client=3, shard_size=250, seed=5)
    assert [len(p) for p in parts] == [750] * 50
    assert len(assert_disjoint(parts, len(y))) == 50 * 750


def test_shards_fail_when_too_few_samples() -> None:
    y = balanced_labels(5000)
    with pytest.raises(PartitionError, match=r"need 60000 samples, have 50000 \(200 shards\)"):
        shards(y, 120, shards_per_client=2, shard_size=250)


# --- label_ratio -----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_label_ratio_skew(seed: int) -> None:
    y = balanced_labels(1000)
    uniform = label_ratio(y, 10, 0.0, seed=seed)
    skewed = label_ratio(y, 10, 0.95, seed=seed)
    assert mean_normalised_entropy(y, uniform) > 0.97
    assert mean_normalised_entropy(y, skewed) < 0.3
    for parts in (uniform, skewed):
        assert len(assert_disjoint(parts, len(y))) == len(y)
        assert max(map(len, parts)) - min(map(len, parts)) <= 2


def test_label_ratio_one_deals_sorted_blocks() -> None:
    y = balanced_labels(100)
    parts = label_ratio(y, 10, 1.0, seed=0)
    # Equal blocks of the label-sorted data: block k is exactly class k here.
    for k, p in enumerate(parts):
        assert client_classes(y, p).tolist() == [k]
    with pytest.raises(PartitionError, match=r"r must be in \[0, 1\]"):
        label_ratio(y, 10, 1.5)


# --- dispatcher and helpers ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "params", "direct"),
    [
        ("iid", {}, lambda y: iid(y, 5, seed=3)),
        (
            "dirichlet",
            {"alpha": 0.2, "min_size": 4},
            lambda y: dirichlet(y, 5, 0.2, min_size=4, seed=3),
        ),
        (
            "shards",
            {"shards_per_client": 3, "shard_size": 40},
            lambda y: shards(y, 5, shards_per_client=3, shard_size=40, seed=3),
        ),
        ("label_ratio", {"ratio": 0.6}, lambda y: label_ratio(y, 5, 0.6, seed=3)),
    ],
)
def test_partition_dispatches(
    kind: PartitionKind,
    params: dict[str, Any],
    direct: Callable[[npt.NDArray[np.int64]], Parts],
) -> None:
    y = balanced_labels(100)
    got, expected = partition(y, kind, 5, seed=3, **params), direct(y)
    assert len(got) == 5
    assert all(np.array_equal(p, q) for p, q in zip(got, expected, strict=True))


def test_partition_validation() -> None:
    y = balanced_labels(10)
    with pytest.raises(PartitionError, match="unknown partition kind 'pathological'"):
        partition(y, "pathological", 3)  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="n_clients"):
        partition(y, "iid", 0)
    with pytest.raises(PartitionError, match="seed must be >= 0"):
        partition(y, "iid", 3, seed=-1)


def test_local_test_indices_hold_exactly_the_client_classes() -> None:
    y_train = balanced_labels(500)
    y_test = balanced_labels(100, seed=9)
    parts = shards(y_train, 10, shards_per_client=3, shard_size=100, seed=1)
    for p in parts:
        mine = client_classes(y_train, p)
        local = local_test_indices(y_test, y_train[p])
        assert len(mine) == 3
        assert np.array_equal(np.unique(y_test[local]), mine)
        # Every test sample of those classes, not just some of them.
        assert len(local) == 100 * len(mine)
        assert local.dtype == np.int64


def test_client_classes_and_label_counts() -> None:
    y = np.array([3, 1, 3, 2, 1, 0], dtype=np.int64)
    assert client_classes(y, [0, 2, 4]).tolist() == [1, 3]
    counts = label_counts(y, [np.array([0, 2, 4]), np.array([1, 3, 5])], 4)
    assert counts.tolist() == [[0, 1, 0, 2], [1, 1, 1, 0]]
