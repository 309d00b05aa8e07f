"""A simulated client's data: the job's dataset, its partition, and each round's batches.

Every process computes the same partition (same labels, kind, parameters and `job.seed`), so
a client only needs its index. One `JobData` loads the dataset and partitions it once; the
embedded runner hands the same instance to all its clients instead of loading N copies.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from services.common.jobdata import job_augmentation, load_job_dataset
from services.config.root import Settings
from services.data.augment import Augmenter
from services.data.batches import Batch, ClientBatches
from services.data.loaders import Dataset
from services.data.partition import client_classes, local_test_indices, partition

Indices = npt.NDArray[np.int64]


class JobData:
    """The dataset and its partition among `clients.count` clients, loaded on first use."""

    def __init__(
        self,
        settings: Settings,
        dataset: Dataset | None = None,
    ) -> None:
        self._settings = settings
        self._dataset = dataset
        self._parts: list[Indices] | None = None
        self._lock = threading.Lock()  # clients of one process share an instance

    @property
    def dataset(self) -> Dataset:
        with self._lock:
            if self._dataset is None:
                self._dataset = load_job_dataset(self._settings)
            return self._dataset

    @property
    def augmenter(self) -> Augmenter | None:
        """What augments the training batches (`[data.augment]`); None: nothing."""
        return job_augmentation(self._settings, self.dataset.info)

    @property
    def clients(self) -> int:
        return self._settings.clients.count

    def indices(self, index: int) -> Indices:
        if not 0 <= index < self.clients:
            raise ValueError(f"partition index {index} outside 0..{self.clients - 1}")
        labels = self.dataset.train.y.numpy()
        with self._lock:
            if self._parts is None:
                d, seed = self._settings.data, self._settings.job.seed
                pool = training_pool(len(labels), d.train_samples, seed)
                parts = partition(
                    labels[pool],
                    d.partition,
                    self.clients,
                    seed=seed,
                    alpha=d.alpha,
                    shards_per_client=d.shards_per_client,
                    shard_size=d.shard_size,
                    distinct_shards=d.distinct_shards,
                    ratio=d.ratio,
                )
                cap = d.client_samples or None
                self._parts = [pool[part][:cap] for part in parts]
            return self._parts[index]

    def classes(self, index: int) -> list[int]:
        return [int(c) for c in client_classes(self.dataset.train.y.numpy(), self.indices(index))]

    def local_test(self, index: int) -> Indices:
        """The personalised test set: test samples of the client's classes (capped)."""
        train_y = self.dataset.train.y.numpy()[self.indices(index)]
        picked = local_test_indices(self.dataset.test.y.numpy(), train_y)
        cap = self._settings.data.eval_samples
        return picked[:cap] if cap else picked


def round_batches(
    batches: ClientBatches, *, local_epochs: int, max_steps: int, round_index: int
) -> tuple[Iterator[Batch], int]:
    """The batches of one round and how many there are (`max_steps`: a cap; 0: none). Epochs
    are numbered across rounds, so each round gets fresh shuffles any process can replay."""
    total = len(batches) * local_epochs
    steps = min(total, max_steps) if max_steps else total
    first = round_index * local_epochs
    epochs = (batches.epoch(first + e) for e in range(local_epochs))
    return itertools.islice(itertools.chain.from_iterable(epochs), steps), steps


def client_batches(data: JobData, index: int, *, batch_size: int, seed: int) -> ClientBatches:
    train = data.dataset.train
    indices = data.indices(index)
    # BatchNorm cannot train on a batch of one sample; drop such a trailing batch.
    drop_last = len(indices) > batch_size and len(indices) % batch_size == 1
    return ClientBatches(
        train.x,
        train.y,
        indices,
        batch_size=batch_size,
        seed=seed,
        client=index,
        drop_last=drop_last,
        augment=data.augmenter,
    )


def training_pool(total: int, wanted: int, seed: int) -> Indices:
    """The training rows a job partitions: all `total` (`wanted` 0 or more than there are), or
    a seeded sample of `wanted` of them, in row order (every process draws the same)."""
    if not wanted or wanted >= total:
        return np.arange(total, dtype=np.int64)
    chosen = np.random.default_rng(seed).choice(total, size=wanted, replace=False)
    return np.sort(chosen).astype(np.int64)
