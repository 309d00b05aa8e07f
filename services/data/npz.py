"""`[data] dataset = "npz"`: a labelled dataset of any shape and class count from `.npz` files.

Which arrays are read (docs/data.md, "npz"):

- one file (`path`): ``x_train``, ``y_train``, ``x_test``, ``y_test``; or only ``x`` and ``y``,
  of which a seeded `test_fraction` becomes the test split;
- two files (`path` for training, `test_path` for testing): ``x`` and ``y`` in each (or
  ``x_train``/``y_train`` and ``x_test``/``y_test``, as one file would name them).
"""

from __future__ import annotations

from pathlib import Path

from services.data.arrays import Array, LabelledArrays, check_pair, hold_out, sample_shape
from services.data.errors import DataFormatError
from services.data.files import npz_arrays, npz_keys, npz_shape

_SPLIT_KEYS = ("x_train", "y_train", "x_test", "y_test")


def _pair_keys(path: Path, split: str) -> tuple[str, str]:
    keys = set(npz_keys(path))
    for pair in (("x", "y"), (f"x_{split}", f"y_{split}")):
        if set(pair) <= keys:
            return pair
    raise DataFormatError(
        path, f"expected arrays x and y (or x_{split} and y_{split}); the file holds {sorted(keys)}"
    )


def _pair(path: Path, split: str) -> tuple[Array, Array]:
    x_key, y_key = _pair_keys(path, split)
    arrays = npz_arrays(path, (x_key, y_key))
    check_pair(arrays[x_key], arrays[y_key], path)
    return arrays[x_key], arrays[y_key]


def read_npz_dataset(
    path: Path, test_path: Path | None, *, test_fraction: float, seed: int
) -> LabelledArrays:
    """Both splits, as the module docstring says; `test_fraction` and `seed` apply only to a
    single file holding ``x``/``y``."""
    if test_path is not None:
        return LabelledArrays(*_pair(path, "train"), *_pair(test_path, "test"))
    if set(_SPLIT_KEYS) <= set(npz_keys(path)):
        arrays = npz_arrays(path, _SPLIT_KEYS)
        check_pair(arrays["x_train"], arrays["y_train"], path)
        check_pair(arrays["x_test"], arrays["y_test"], path)
        return LabelledArrays(
            arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"]
        )
    x, y = _pair(path, "train")
    return LabelledArrays(*hold_out(x, y, test_fraction, seed, path))


def npz_input_shape(path: Path, test_path: Path | None) -> tuple[int, ...]:
    """One sample's shape, (C, H, W) or (F,), from the array headers alone."""
    keys = set(npz_keys(path))
    if test_path is None and set(_SPLIT_KEYS) <= keys:
        x_key = "x_train"
    else:
        x_key = _pair_keys(path, "train")[0]
    return sample_shape(npz_shape(path, x_key), path)
