"""`data.train_samples` and `data.client_samples`: train on part of a dataset, the same part in
every process, with the partitioners working on it unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from services.client.data import JobData, training_pool
from services.config.root import Settings


def job_data(**data: object) -> JobData:
    settings = Settings.model_validate(
        {"clients": {"count": 4}, "data": {"dataset": "fashion_mnist_sample", **data}}
    )
    return JobData(settings)


def test_the_whole_set_by_default() -> None:
    data = job_data()
    total = len(data.dataset.train.y)
    rows = np.concatenate([data.indices(k) for k in range(4)])
    assert sorted(rows.tolist()) == list(range(total))


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_train_samples_is_one_seeded_subset_partitioned(kind: str) -> None:
    data = job_data(train_samples=1000, partition=kind, shard_size=100)
    parts = [data.indices(k) for k in range(4)]
    rows = np.concatenate(parts)
    assert len(rows) == len(set(rows.tolist())) <= 1000  # disjoint, within the sample
    assert set(rows.tolist()) <= set(training_pool(len(data.dataset.train.y), 1000, 0).tolist())
    again = job_data(train_samples=1000, partition=kind, shard_size=100)
    assert all(np.array_equal(a, again.indices(k)) for k, a in enumerate(parts))  # every process


def test_client_samples_caps_each_client() -> None:
    capped = job_data(client_samples=50)
    whole = job_data()
    for k in range(4):
        assert len(capped.indices(k)) == 50
        assert np.array_equal(capped.indices(k), whole.indices(k)[:50])


def test_the_pool() -> None:
    assert np.array_equal(training_pool(10, 0, 3), np.arange(10))
    assert np.array_equal(training_pool(10, 99, 3), np.arange(10))
    pool = training_pool(1000, 100, 3)
    assert len(pool) == 100 and np.all(np.diff(pool) > 0)
    assert not np.array_equal(pool, training_pool(1000, 100, 4))  # another seed, other rows
