"""A labelled dataset as numpy arrays, before it becomes tensors: what every source yields.

Built-in files, the generic `.npz` and image-folder readers and plugins all produce a
`LabelledArrays`; `services.data.loaders` turns it into normalised tensors in one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from services.data.errors import DataFormatError
from services.data.registry import NO_AUGMENTATION, Augmentation

Array = npt.NDArray[Any]


@dataclass(frozen=True, eq=False)
class LabelledArrays:
    """Both splits of a dataset.

    ``x_*``: images [N,H,W], [N,H,W,C] or [N,C,H,W] (uint8 on 0..255, or float already on
    the [0, 1] scale), or feature vectors [N,F] (any float or integer type); ``y_*``: integer
    labels 0..K-1. The layout of 4-D arrays is told by `image_layout`.
    """

    x_train: Array
    y_train: Array
    x_test: Array
    y_test: Array
    class_names: tuple[str, ...] = ()
    """One name per class; (): "0".."K-1", K inferred from the largest label."""
    mean: tuple[float, ...] = ()
    """Per-channel normalisation constants on the [0, 1] scale; (): measured on x_train."""
    std: tuple[float, ...] = ()
    augment: Augmentation = NO_AUGMENTATION
    """The dataset's default augmentation (`[data.augment]` overrides it)."""


def channels_last(shape: tuple[int, ...]) -> bool:
    """Whether a 4-D image array [N,a,b,c] is [N,H,W,C]: its channels are the smaller of axis 1
    and the last axis, the last one on a tie (so [N,32,32,3] is NHWC, [N,3,32,32] NCHW)."""
    return shape[3] <= shape[1]


def _bad_shape(shape: tuple[int, ...]) -> str:
    return f"x has shape {shape}: expected images [N,H,W(,C)] or [N,C,H,W], or [N,F]"


def sample_shape(shape: tuple[int, ...], source: object) -> tuple[int, ...]:
    """One sample's shape as models see it, (C, H, W) or (F,), for an array of ``shape``."""
    if len(shape) == 2:
        return (shape[1],)
    if len(shape) == 3:
        return (1, shape[1], shape[2])
    if len(shape) == 4:
        return (shape[3], shape[1], shape[2]) if channels_last(shape) else tuple(shape[1:])
    raise DataFormatError(source, _bad_shape(shape))


def channels_first(x: Array, source: object) -> Array:
    """Images as a [N,C,H,W] view (no copy), or feature vectors [N,F] as they are."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x[:, np.newaxis]
    if x.ndim == 4:
        return x.transpose(0, 3, 1, 2) if channels_last(x.shape) else x
    raise DataFormatError(source, _bad_shape(x.shape))


def check_pair(x: Array, y: Array, source: object) -> None:
    """Refuse what no model could train on: object arrays, non-integer labels, a count mismatch."""
    if not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
        raise DataFormatError(source, f"x must be numeric, got {x.dtype}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataFormatError(source, f"expected integer labels [N], got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataFormatError(source, f"{len(y)} labels for {len(x)} samples")
    if len(y) and int(y.min()) < 0:
        raise DataFormatError(source, f"labels must be >= 0, found {int(y.min())}")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataFormatError(source, "x holds NaN or infinite values")


def hold_out(
    x: Array, y: Array, fraction: float, seed: int, source: object
) -> tuple[Array, Array, Array, Array]:
    """``(x_train, y_train, x_test, y_test)``: a seeded random ``fraction`` held out as the test
    split, for data that comes without one."""
    if not 0 < fraction < 1:
        raise DataFormatError(
            source, f"no test split, and data.test_fraction = {fraction:g}: set it in (0, 1)"
        )
    n_test = max(1, round(fraction * len(y)))
    if n_test >= len(y):
        raise DataFormatError(source, f"{len(y)} samples are too few to hold {n_test} out")
    order = np.random.default_rng(np.random.SeedSequence([seed, len(y)])).permutation(len(y))
    test, train = np.sort(order[:n_test]), np.sort(order[n_test:])
    return x[train], y[train], x[test], y[test]
