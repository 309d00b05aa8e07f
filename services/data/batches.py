"""Per-client minibatches over tensors already in memory.

A client's data is an index array into the preloaded dataset tensors, so a batch is one
``index_select``: no copies of the client's data, no DataLoader worker processes. The shuffle
order of an epoch depends only on ``(seed, client, epoch)``, and an augmented batch's crops and
flips only on ``(seed, client, epoch, batch)``, so a client restarted at epoch e replays exactly
the batches it would have seen, whichever process runs it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from services.data.augment import Augmenter, batch_generator


class Batch(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


def epoch_order(n: int, *, seed: int, client: int, epoch: int) -> npt.NDArray[np.int64]:
    """The permutation of ``range(n)`` used by ``client`` in ``epoch``.

    ``SeedSequence`` mixes the three integers, so neighbouring clients or epochs get
    unrelated streams (``seed + client`` would make client 1 of seed 0 equal client 0 of seed 1).
    """
    if min(seed, client, epoch) < 0:
        raise ValueError(f"seed, client and epoch must be >= 0, got {(seed, client, epoch)}")
    rng = np.random.default_rng(np.random.SeedSequence([seed, client, epoch]))
    return rng.permutation(n).astype(np.int64)


class ClientBatches:
    """Shuffled minibatches of one client's partition of ``(x, y)``.

    ``indices`` (numpy or a list) selects the client's samples from ``x``/``y`` (any shape
    [N, ...] / [N]). Batches live on the device of ``x``; ``y`` must be on the same device.
    ``augment`` (training batches only) transforms each batch, seeded per batch.
    """

    def __init__(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        indices: npt.ArrayLike,
        *,
        batch_size: int,
        seed: int,
        client: int,
        shuffle: bool = True,
        drop_last: bool = False,
        augment: Augmenter | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x has {x.shape[0]} samples but y has {y.shape[0]}")
        idx = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        if idx.ndim != 1:
            raise ValueError(f"indices must be 1-D, got shape {tuple(idx.shape)}")
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= x.shape[0]):
            raise ValueError(f"indices out of range for {x.shape[0]} samples")
        self.x = x
        self.y = y
        self.indices = idx.to(x.device)
        self.batch_size = batch_size
        self.seed = seed
        self.client = client
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.augment = augment

    def __len__(self) -> int:
        """Batches per epoch."""
        n, b = len(self.indices), self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def epoch(self, epoch: int) -> Iterator[Batch]:
        """The batches of ``epoch``, in that epoch's seeded order."""
        order = self.indices
        if self.shuffle:
            perm = epoch_order(len(order), seed=self.seed, client=self.client, epoch=epoch)
            order = order[torch.from_numpy(perm).to(order.device)]
        # `split` of nothing is one empty chunk, not none.
        chunks = order[: len(self) * self.batch_size].split(self.batch_size) if len(self) else ()
        if self.augment is not None:
            return self._augmented(epoch, chunks)
        # Torch's calls alone per batch (no generator of ours to resume): this is every
        # training batch's path (docs/architecture.md, "A batch's round trip").
        xs = map(partial(torch.index_select, self.x, 0), chunks)
        return map(Batch, xs, map(partial(torch.index_select, self.y, 0), chunks))

    def _augmented(self, epoch: int, chunks: Sequence[torch.Tensor]) -> Iterator[Batch]:
        """The batches of `chunks`, each transformed with draws seeded by its number."""
        assert self.augment is not None
        for number, chunk in enumerate(chunks):
            draws = batch_generator(seed=self.seed, client=self.client, epoch=epoch, batch=number)
            x = self.augment(self.x.index_select(0, chunk), draws)
            yield Batch(x, self.y.index_select(0, chunk))
