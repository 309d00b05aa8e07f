"""Client-side augmentation: crop with black padding, flip, seeding, and where it applies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.client.data import JobData, client_batches, round_batches
from services.common.jobdata import job_augmentation
from services.config.root import Settings
from services.data.augment import Augmenter, batch_generator
from services.data.batches import ClientBatches
from services.data.registry import Augmentation, DatasetInfo

INFO = DatasetInfo("toy", (3, 8, 8), tuple("0123456789"), (0.5, 0.4, 0.3), (0.2, 0.25, 0.5))
BLACK = torch.tensor([-m / s for m, s in zip(INFO.mean, INFO.std, strict=True)])


def images(n: int = 64, h: int = 8, w: int = 8) -> torch.Tensor:
    # Distinct values everywhere, so where a pixel came from is unambiguous.
    return torch.arange(n * 3 * h * w, dtype=torch.float32).view(n, 3, h, w) + 1000.0


def shifted(x: torch.Tensor, dy: int, dx: int, fill: torch.Tensor) -> torch.Tensor:
    """`x` [C,H,W] seen through a window moved by (dy, dx) over its black-padded copy."""
    c, h, w = x.shape
    out = fill.view(c, 1, 1).expand(c, h, w).clone()
    rs, re = max(0, dy), min(h, h + dy)
    cs, ce = max(0, dx), min(w, w + dx)
    out[:, rs - dy : re - dy, cs - dx : ce - dx] = x[:, rs:re, cs:ce]
    return out


def augment(params: Augmentation, x: torch.Tensor, batch: int = 0) -> torch.Tensor:
    augmenter = Augmenter.for_data(params, INFO)
    return augmenter(x, batch_generator(seed=0, client=1, epoch=2, batch=batch))


def test_shapes_dtype_and_the_input_left_alone() -> None:
    x = images()
    before = x.clone()
    out = augment(Augmentation(crop_padding=2, horizontal_flip=True), x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert torch.equal(x, before)
    assert not torch.equal(out, x)


def test_flip_mirrors_about_half_of_the_images_and_nothing_else() -> None:
    x = images(n=400)
    out = augment(Augmentation(horizontal_flip=True), x)
    flipped = [bool(torch.equal(o, i.flip(2))) for o, i in zip(out, x, strict=True)]
    kept = [bool(torch.equal(o, i)) for o, i in zip(out, x, strict=True)]
    assert all(f != k for f, k in zip(flipped, kept, strict=True)), "each image flipped or kept"
    assert 160 <= sum(flipped) <= 240


def test_crop_shifts_each_image_within_the_padding_with_a_black_border() -> None:
    x = images(n=128)
    pad = 2
    out = augment(Augmentation(crop_padding=pad), x)
    found = []
    for o, i in zip(out, x, strict=True):
        matches = [
            (dy, dx)
            for dy in range(-pad, pad + 1)
            for dx in range(-pad, pad + 1)
            if torch.equal(o, shifted(i, dy, dx, BLACK))
        ]
        assert len(matches) == 1, "every output is one shift of its input"
        found.append(matches[0])
    assert len(set(found)) >= 15, "the shifts cover the (2p+1)^2 offsets"
    assert (0, 0) in found and any(abs(dy) == pad for dy, _ in found)


def test_crop_and_flip_together_crop_then_mirror() -> None:
    x = images(n=200)
    out = augment(Augmentation(crop_padding=1, horizontal_flip=True), x)
    flipped = 0
    for o, i in zip(out, x, strict=True):
        options = {
            (dy, dx, f)
            for dy in (-1, 0, 1)
            for dx in (-1, 0, 1)
            for f in (False, True)
            if torch.equal(o, shifted(i, dy, dx, BLACK).flip(2) if f else shifted(i, dy, dx, BLACK))
        }
        assert options, "a crop, possibly mirrored"
        flipped += all(f for _, _, f in options)
    assert 60 <= flipped <= 140


def test_the_draws_are_seeded_by_seed_client_epoch_and_batch() -> None:
    x = images()
    params = Augmentation(crop_padding=4, horizontal_flip=True)
    augmenter = Augmenter.for_data(params, INFO)

    def run(**key: int) -> torch.Tensor:
        return augmenter(
            x, batch_generator(**{"seed": 0, "client": 0, "epoch": 0, "batch": 0, **key})
        )

    base = run()
    assert torch.equal(base, run())
    for key in ("seed", "client", "epoch", "batch"):
        assert not torch.equal(base, run(**{key: 1})), key


def test_unnormalised_data_pads_with_zero() -> None:
    info = DatasetInfo("raw", (1, 4, 4), ("a", "b"))
    augmenter = Augmenter.for_data(Augmentation(crop_padding=4), info)
    assert augmenter.fill.tolist() == [0.0]


def test_feature_vectors_cannot_be_augmented() -> None:
    info = DatasetInfo("table", (12,), ("a", "b"))
    with pytest.raises(ValueError, match=r"crops and flips images.*\(12,\)"):
        Augmenter.for_data(Augmentation(horizontal_flip=True), info)


def test_the_section_overrides_the_dataset_defaults() -> None:
    info = DatasetInfo("d", (3, 8, 8), ("a", "b"), augment=Augmentation(4, True))

    def params(augment: dict[str, object]) -> Augmentation | None:
        settings = Settings.model_validate({"data": {"augment": augment}})
        found = job_augmentation(settings, info)
        return None if found is None else found.params

    assert params({}) == Augmentation(4, True)
    assert params({"crop_padding": 0}) == Augmentation(0, True)
    assert params({"crop_padding": 0, "horizontal_flip": False}) is None
    plain = DatasetInfo("p", (3, 8, 8), ("a", "b"))
    settings = Settings.model_validate({"data": {"augment": {"crop_padding": 3}}})
    found = job_augmentation(settings, plain)
    assert found is not None and found.params == Augmentation(3, False)


def test_client_batches_augment_training_only_and_replay_in_any_process() -> None:
    settings = Settings.model_validate(
        {
            "data": {"augment": {"crop_padding": 4, "horizontal_flip": True}},
            "clients": {"count": 4},
        }
    )
    plain = Settings.model_validate({"clients": {"count": 4}})
    # Two JobData of their own, as a standalone client and a client host would have.
    first, second, reference = JobData(settings), JobData(settings), JobData(plain)

    def one_round(data: JobData) -> list[tuple[torch.Tensor, torch.Tensor]]:
        batches, _ = round_batches(
            client_batches(data, 2, batch_size=32, seed=0),
            local_epochs=1,
            max_steps=3,
            round_index=5,
        )
        return [(b.x, b.y) for b in batches]

    a, b, raw = one_round(first), one_round(second), one_round(reference)
    assert len(a) == len(raw) == 3
    assert all(torch.equal(p[0], q[0]) for p, q in zip(a, b, strict=True))
    assert not any(torch.equal(p[0], r[0]) for p, r in zip(a, raw, strict=True))
    # The same samples in the same order: only the images changed.
    assert all(torch.equal(p[1], r[1]) for p, r in zip(a, raw, strict=True))
    # The test split, which evaluation and the personal accuracy read, is never augmented.
    assert torch.equal(first.dataset.test.x, reference.dataset.test.x)


def test_unaugmented_batches_are_the_dataset_rows() -> None:
    x = images(n=20)
    y = torch.arange(20)
    batches = ClientBatches(x, y, np.arange(20), batch_size=8, seed=0, client=0)
    for batch in batches.epoch(0):
        assert torch.equal(batch.x, x[batch.y])
