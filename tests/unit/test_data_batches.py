"""Per-client minibatch iteration: coverage, drop_last, seeded order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.data.batches import ClientBatches, epoch_order


def make_data(n: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    # Sample i carries its own index as pixel value, so a batch reveals which samples it holds.
    x = torch.arange(n, dtype=torch.float32).view(n, 1, 1, 1).expand(n, 1, 2, 2).contiguous()
    y = torch.arange(n, dtype=torch.int64) % 10
    return x, y


def batch_ids(batches: ClientBatches, epoch: int) -> list[list[int]]:
    return [b.x[:, 0, 0, 0].long().tolist() for b in batches.epoch(epoch)]


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def test_epoch_covers_the_client_indices_once() -> None:
    x, y = make_data()
    indices = np.array([3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37])
    batches = ClientBatches(x, y, indices, batch_size=4, seed=0, client=2)
    ids = batch_ids(batches, 0)
    assert [len(b) for b in ids] == [4, 4, 3]
    assert len(batches) == 3
    assert sorted(flat(ids)) == indices.tolist()
    for batch in batches.epoch(0):
        assert batch.x.shape[1:] == (1, 2, 2)
        assert torch.equal(batch.y, batch.x[:, 0, 0, 0].long() % 10)


def test_drop_last() -> None:
    x, y = make_data()
    batches = ClientBatches(x, y, np.arange(10), batch_size=4, seed=0, client=0, drop_last=True)
    ids = batch_ids(batches, 0)
    assert len(batches) == 2
    assert [len(b) for b in ids] == [4, 4]
    assert len(set(flat(ids))) == 8


def test_order_depends_on_seed_client_and_epoch_only() -> None:
    x, y = make_data()
    idx = np.arange(0, 100, 2)

    def order(seed: int, client: int, epoch: int) -> list[list[int]]:
        return batch_ids(ClientBatches(x, y, idx, batch_size=8, seed=seed, client=client), epoch)

    base = order(1, 4, 2)
    assert base == order(1, 4, 2), "same (seed, client, epoch), same batches"
    assert base != order(1, 4, 3)
    assert base != order(1, 5, 2)
    assert base != order(2, 4, 2)
    # Mixing, not adding: (seed 0, client 1) must not equal (seed 1, client 0).
    assert order(0, 1, 0) != order(1, 0, 0)
    assert sorted(flat(order(1, 4, 3))) == idx.tolist()


def test_no_shuffle_keeps_index_order() -> None:
    x, y = make_data()
    idx = np.array([9, 2, 5, 1])
    batches = ClientBatches(x, y, idx, batch_size=3, seed=0, client=0, shuffle=False)
    assert batch_ids(batches, 0) == [[9, 2, 5], [1]]
    assert batch_ids(batches, 1) == [[9, 2, 5], [1]]


def test_epoch_order_is_a_permutation() -> None:
    perm = epoch_order(50, seed=3, client=1, epoch=0)
    assert sorted(perm.tolist()) == list(range(50))
    assert np.array_equal(perm, epoch_order(50, seed=3, client=1, epoch=0))
    with pytest.raises(ValueError, match=">= 0"):
        epoch_order(5, seed=-1, client=0, epoch=0)


def test_invalid_inputs() -> None:
    x, y = make_data(10)
    with pytest.raises(ValueError, match="batch_size"):
        ClientBatches(x, y, [0], batch_size=0, seed=0, client=0)
    with pytest.raises(ValueError, match="out of range"):
        ClientBatches(x, y, [0, 10], batch_size=2, seed=0, client=0)
    with pytest.raises(ValueError, match="x has 10 samples but y has 9"):
        ClientBatches(x, y[:9], [0], batch_size=2, seed=0, client=0)


def test_empty_partition_yields_nothing() -> None:
    x, y = make_data(10)
    batches = ClientBatches(x, y, np.array([], dtype=np.int64), batch_size=2, seed=0, client=0)
    assert len(batches) == 0
    assert list(batches.epoch(0)) == []
