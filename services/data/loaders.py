"""Load a registered dataset into normalised NCHW float32 tensors and int64 labels.

Data directory resolution, first match wins:

1. the ``data_dir`` argument (when given, it is the only place searched: an explicit choice
   that silently fell back elsewhere would hide a typo);
2. the ``SPLITMQ_DATA_DIR`` environment variable;
3. the copy shipped with the package, for bundled datasets only (``fashion_mnist_sample``).

A directory matches when it holds every file of both splits; the error when none does lists
each directory searched and every file expected.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from services.data.errors import DataFormatError, DatasetNotFoundError
from services.data.files import read_idx_pair, read_npz
from services.data.registry import SAMPLE_DIR, DatasetSpec, SplitFiles, get_spec

DATA_DIR_ENV = "SPLITMQ_DATA_DIR"
_SPLITS = ("train", "test")
# Normalising in blocks bounds the temporaries to a few MB whatever the dataset size.
_BLOCK = 4096

Images = npt.NDArray[np.uint8]
Labels = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Split:
    """One split in memory: ``x`` float32 [N, C, H, W] (normalised), ``y`` int64 [N]."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True, eq=False)
class Dataset:
    spec: DatasetSpec
    root: Path
    train: Split
    test: Split


def _idx_paths(files: SplitFiles, root: Path) -> tuple[Path, Path] | None:
    if files.idx is None:
        return None
    images, labels = (
        next((root / c for c in files.idx.candidates(name) if (root / c).is_file()), None)
        for name in (files.idx.images, files.idx.labels)
    )
    return None if images is None or labels is None else (images, labels)


def _split_available(files: SplitFiles, root: Path) -> bool:
    if all((root / name).is_file() for name in files.npz):
        return True
    return _idx_paths(files, root) is not None


def _describe(spec: DatasetSpec) -> str:
    lines = []
    for which in _SPLITS:
        files = spec.split(which)
        line = f"  {which}: {', '.join(files.npz)}"
        if files.idx is not None:
            line += f" (or IDX {files.idx.images}[.gz] + {files.idx.labels}[.gz])"
        lines.append(line)
    return "\n".join(lines)


def resolve_data_dir(
    spec: DatasetSpec,
    data_dir: str | Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Path:
    """The directory to load ``spec`` from (see the module docstring for the order)."""
    env = os.environ if env is None else env
    candidates: list[tuple[str, Path]] = []
    if data_dir is not None:
        candidates.append(("data_dir argument", Path(data_dir)))
    else:
        if env.get(DATA_DIR_ENV):
            candidates.append((DATA_DIR_ENV, Path(env[DATA_DIR_ENV])))
        if spec.bundled:
            candidates.append(("shipped sample", SAMPLE_DIR))
    for _, root in candidates:
        if all(_split_available(spec.split(w), root) for w in _SPLITS):
            return root
    if candidates:
        searched = "; ".join(f"{root} ({origin})" for origin, root in candidates)
        where = f"looked in: {searched}"
    else:
        where = f"no data directory given: pass data_dir or set {DATA_DIR_ENV}"
    raise DatasetNotFoundError(
        f"dataset {spec.name!r} not found; {where}\nexpected files:\n{_describe(spec)}"
    )


def _check_arrays(spec: DatasetSpec, source: object, x: Images, y: npt.NDArray[np.integer]) -> None:
    expected = (spec.height, spec.width, spec.channels)
    got = tuple(x.shape[1:]) + ((1,) if x.ndim == 3 else ())
    if got != expected:
        raise DataFormatError(
            source, f"images are {x.shape[1:]}, {spec.name} needs H,W,C {expected}"
        )
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= spec.num_classes):
        raise DataFormatError(
            source,
            f"labels span {int(y.min())}..{int(y.max())}, {spec.name} has "
            f"{spec.num_classes} classes",
        )


def load_split_arrays(spec: DatasetSpec, which: str, root: str | Path) -> tuple[Images, Labels]:
    """Raw uint8 images [N,H,W] or [N,H,W,C] and int64 labels of one split, validated."""
    root = Path(root)
    files = spec.split(which)
    if all((root / name).is_file() for name in files.npz):
        parts = [read_npz(root / name, files.x_key, files.y_key) for name in files.npz]
        for name, (px, py) in zip(files.npz, parts, strict=True):
            _check_arrays(spec, root / name, px, py)
        if len(parts) == 1:
            x, y = parts[0]
        else:
            x = np.concatenate([p[0] for p in parts])
            y = np.concatenate([p[1] for p in parts])
        return x, y.astype(np.int64)
    idx = _idx_paths(files, root)
    if idx is None:
        raise DatasetNotFoundError(
            f"{spec.name} {which} split not found in {root}; expected:\n{_describe(spec)}"
        )
    x, y8 = read_idx_pair(*idx)
    _check_arrays(spec, idx[0], x, y8)
    return x, y8.astype(np.int64)


def to_tensor(x: Images, mean: Sequence[float], std: Sequence[float]) -> torch.Tensor:
    """uint8 [N,H,W] or [N,H,W,C] -> float32 [N,C,H,W] holding ``(x/255 - mean) / std``."""
    if x.ndim == 3:
        x = x[..., np.newaxis]
    n, h, w, c = x.shape
    if len(mean) != c or len(std) != c:
        raise ValueError(f"{c} channels but {len(mean)} means and {len(std)} stds")
    if not (x.flags.writeable and x.flags.c_contiguous):
        x = np.ascontiguousarray(x).copy()  # torch.from_numpy warns on read-only arrays
    src = torch.from_numpy(x)
    scale = torch.tensor([1.0 / (255.0 * s) for s in std], dtype=torch.float32).view(1, c, 1, 1)
    shift = torch.tensor([m / s for m, s in zip(mean, std, strict=True)], dtype=torch.float32)
    shift = shift.view(1, c, 1, 1)
    out = torch.empty((n, c, h, w), dtype=torch.float32)
    for start in range(0, n, _BLOCK):
        block = out[start : start + _BLOCK]
        block.copy_(src[start : start + _BLOCK].permute(0, 3, 1, 2))
        block.mul_(scale).sub_(shift)
    return out


def load_dataset(
    name: str, data_dir: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> Dataset:
    """Load both splits of a registered dataset, normalised with the registry's mean/std.

    ``env`` defaults to ``os.environ``; tests pass their own mapping.
    """
    spec = get_spec(name)
    root = resolve_data_dir(spec, data_dir, env)
    splits = []
    for which in _SPLITS:
        x, y = load_split_arrays(spec, which, root)
        splits.append(Split(to_tensor(x, spec.mean, spec.std), torch.from_numpy(y)))
    return Dataset(spec=spec, root=root, train=splits[0], test=splits[1])
