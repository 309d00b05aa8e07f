"""Load a job's dataset into normalised float32 tensors and int64 labels.

`load_data` reads any source (a built-in or plugin spec's files, the generic `.npz` and
image-folder kinds, a plugin's loader) into `LabelledArrays` and normalises them here, in one
place: uint8 pixels are scaled to [0, 1] (float images are taken to be on that scale already),
then each channel has its mean subtracted and is divided by its std, the constants being the
request's overrides, else the source's own, else measured on the training split. Feature
vectors [N, F] are used as they are.

A built-in dataset's data directory is resolved as follows, first match wins:

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

from services.data.arrays import (
    Array,
    LabelledArrays,
    channels_first,
    check_pair,
    sample_shape,
)
from services.data.errors import DataFormatError, DatasetNotFoundError, UnknownDatasetError
from services.data.files import read_idx_pair, read_npz
from services.data.folder import image_folder_shape, read_image_folder
from services.data.npz import npz_input_shape, read_npz_dataset
from services.data.plugins import Loader, PluginLookup, Plugins
from services.data.registry import (
    DATASETS,
    GENERIC_KINDS,
    SAMPLE_DIR,
    DatasetInfo,
    DatasetSpec,
    SplitFiles,
)
from services.data.request import DataRequest

DATA_DIR_ENV = "SPLITMQ_DATA_DIR"
_SPLITS = ("train", "test")
# Normalising in blocks bounds the temporaries to a few MB whatever the dataset size.
_BLOCK = 4096

Images = npt.NDArray[np.uint8]
Labels = npt.NDArray[np.int64]


@dataclass(frozen=True, eq=False)
class Split:
    """One split in memory: ``x`` float32 [N, C, H, W] (normalised) or [N, F], ``y`` int64."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return int(self.y.shape[0])


@dataclass(frozen=True, eq=False)
class Dataset:
    info: DatasetInfo
    root: Path
    """Where it was read from: the data directory, or the generic kinds' file or folder."""
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


def to_tensor(x: Array, mean: Sequence[float] = (), std: Sequence[float] = ()) -> torch.Tensor:
    """Images (any layout of `channels_first`, uint8 or float) -> float32 [N,C,H,W] holding
    ``(x * scale - mean) / std`` (no normalisation when ``mean`` is empty); [N,F] -> float32."""
    view = channels_first(x, "x")
    n = view.shape[0]
    c = view.shape[1] if view.ndim == 4 else 0
    if mean and (len(mean) != c or len(std) != c):
        raise ValueError(f"{c} channels but {len(mean)} means and {len(std)} stds")
    out = torch.empty(view.shape, dtype=torch.float32)
    # Python floats, as earlier versions computed them: the tensors stay bit for bit the same.
    range_ = 255.0 if x.dtype == np.uint8 else 1.0
    stds = tuple(std) if mean else (1.0,) * max(c, 1)
    means = tuple(mean) if mean else (0.0,) * max(c, 1)
    scale = torch.tensor([1.0 / (range_ * s) for s in stds], dtype=torch.float32)
    shift = torch.tensor([m / s for m, s in zip(means, stds, strict=True)], dtype=torch.float32)
    shape = (1, -1, 1, 1) if view.ndim == 4 else (1, 1)
    scale, shift = scale.view(shape), shift.view(shape)
    for start in range(0, n, _BLOCK):
        # A block at a time: the temporaries stay a few MB whatever the dataset size.
        part = np.ascontiguousarray(view[start : start + _BLOCK])
        if not part.flags.writeable:
            part = part.copy()  # torch.from_numpy warns on read-only arrays
        block = out[start : start + _BLOCK]
        block.copy_(torch.from_numpy(part))
        block.mul_(scale).sub_(shift)
    return out


def channel_stats(x: Array) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and std of images (any `channels_first` layout) on the [0, 1] scale."""
    view = channels_first(x, "x")
    total = np.zeros(view.shape[1])
    squares = np.zeros(view.shape[1])
    for start in range(0, view.shape[0], _BLOCK):
        block = view[start : start + _BLOCK].astype(np.float64)
        if x.dtype == np.uint8:
            block /= 255.0
        total += block.sum(axis=(0, 2, 3))
        squares += np.square(block).sum(axis=(0, 2, 3))
    count = view.shape[0] * view.shape[2] * view.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean**2, 0.0))
    # A constant channel would divide by zero; leave it unscaled instead.
    return tuple(float(m) for m in mean), tuple(float(s) if s > 1e-8 else 1.0 for s in std)


def _normalisation(
    arrays: LabelledArrays, request: DataRequest, source: object
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    if arrays.x_train.ndim == 2:
        if request.mean or request.std:
            raise DataFormatError(
                source, "data.mean/data.std are per image channel; these samples are [N,F] vectors"
            )
        return (), ()
    if not request.normalize:
        return (), ()
    channels = sample_shape(arrays.x_train.shape, source)[0]
    mean, std = request.mean or arrays.mean, request.std or arrays.std
    if bool(request.mean) != bool(request.std):
        raise DataFormatError(source, "set both data.mean and data.std, or neither")
    if not mean:
        mean, std = channel_stats(arrays.x_train)
    if len(mean) != channels or len(std) != channels:
        raise DataFormatError(
            source,
            f"the images have {channels} channel(s) but data.mean/std give "
            f"{len(mean)}/{len(std)} values",
        )
    if min(std) <= 0:
        raise DataFormatError(source, f"data.std must be > 0, got {std}")
    return tuple(mean), tuple(std)


def _class_names(arrays: LabelledArrays, source: object) -> tuple[str, ...]:
    top = max((int(y.max()) for y in (arrays.y_train, arrays.y_test) if len(y)), default=-1)
    if not arrays.class_names:
        if top < 1:
            raise DataFormatError(source, f"labels span 0..{top}: a task needs two classes")
        return tuple(str(k) for k in range(top + 1))
    if top >= len(arrays.class_names):
        raise DataFormatError(
            source, f"labels span 0..{top} but {len(arrays.class_names)} class names are given"
        )
    return arrays.class_names


def to_dataset(name: str, root: Path, arrays: LabelledArrays, request: DataRequest) -> Dataset:
    """`arrays` as normalised tensors, checked for a consistent sample shape and labels (the
    readers check their files first, naming the file; this also covers plugins' arrays)."""
    check_pair(arrays.x_train, arrays.y_train, f"{root} (training split)")
    check_pair(arrays.x_test, arrays.y_test, f"{root} (test split)")
    shape = sample_shape(arrays.x_train.shape, root)
    test_shape = sample_shape(arrays.x_test.shape, root)
    if test_shape != shape:
        raise DataFormatError(root, f"training samples are {shape} but test samples {test_shape}")
    mean, std = _normalisation(arrays, request, root)
    info = DatasetInfo(name, shape, _class_names(arrays, root), mean, std, arrays.augment)
    train, test = (
        Split(to_tensor(x, mean, std), torch.from_numpy(np.asarray(y, dtype=np.int64)))
        for x, y in ((arrays.x_train, arrays.y_train), (arrays.x_test, arrays.y_test))
    )
    return Dataset(info=info, root=root, train=train, test=test)


# --- sources --------------------------------------------------------------------------------

Source = DatasetSpec | str | Loader
"""What a dataset name stands for: a spec's files, a generic kind, or a plugin's loader."""


def find_source(name: str, plugins: PluginLookup | None = None) -> Source:
    """The source `name` stands for; `UnknownDatasetError` lists every known name."""
    if name in DATASETS:
        return DATASETS[name]
    if name in GENERIC_KINDS:
        return name
    plugins = plugins or Plugins()
    found = plugins.get(name)
    if found is not None:
        return found
    extra = f"; plugins: {', '.join(plugins.names())}" if plugins.names() else ""
    raise UnknownDatasetError(
        f"unknown dataset {name!r}; built-in: {', '.join(sorted(DATASETS))}; read from "
        f"[data] path: {', '.join(GENERIC_KINDS)}{extra}"
    )


def _generic_path(request: DataRequest, key: str) -> Path | None:
    value = getattr(request, key)
    if not value:
        return None
    path = request.resolve(value)
    if not path.exists():
        base = f"data.dir {request.dir}" if request.dir else "the working directory"
        raise DatasetNotFoundError(
            f"data.{key} {value!r} not found (looked for {path}; a relative path is relative "
            f"to {base}); every client reads it itself, so it must exist on each client's "
            "machine"
        )
    return path


def _required_path(request: DataRequest) -> Path:
    path = _generic_path(request, "path")
    if path is None:
        what = "an .npz file" if request.dataset == "npz" else "a folder of class folders"
        raise DatasetNotFoundError(
            f"data.dataset = {request.dataset!r} reads [data] path ({what}), which is not set"
        )
    return path


def load_data(
    request: DataRequest, env: Mapping[str, str] | None = None, plugins: PluginLookup | None = None
) -> Dataset:
    """The dataset `request` asks for, normalised (module docstring); ``env`` defaults to
    ``os.environ`` (the built-ins' data directory)."""
    source = find_source(request.dataset, plugins)
    if isinstance(source, DatasetSpec):
        root = resolve_data_dir(source, request.dir or None, env)
        (x_train, y_train), (x_test, y_test) = (
            load_split_arrays(source, which, root) for which in _SPLITS
        )
        arrays = LabelledArrays(
            x_train, y_train, x_test, y_test, source.class_names, source.mean, source.std,
            source.augment,
        )  # fmt: skip
        return to_dataset(source.name, root, arrays, request)
    if source in GENERIC_KINDS:
        root = _required_path(request)
        fraction, seed = request.test_fraction, request.seed
        if source == "npz":
            test_path = _generic_path(request, "test_path")
            arrays = read_npz_dataset(root, test_path, test_fraction=fraction, seed=seed)
        else:
            size = request.image_size
            arrays = read_image_folder(root, image_size=size, test_fraction=fraction, seed=seed)
        return to_dataset(root.name, root, arrays, request)
    assert callable(source)
    return to_dataset(request.dataset, Path(request.path or "."), source(request), request)


def input_shape(
    request: DataRequest, env: Mapping[str, str] | None = None, plugins: PluginLookup | None = None
) -> tuple[int, ...]:
    """One sample's shape, (C, H, W) or (F,), read as cheaply as the source allows: a spec's
    declared shape, the `.npz` headers, the images' headers; a plugin's loader is called."""
    source = find_source(request.dataset, plugins)
    if isinstance(source, DatasetSpec):
        return source.info.input_shape
    if source == "npz":
        return npz_input_shape(_required_path(request), _generic_path(request, "test_path"))
    if source == "image_folder":
        return image_folder_shape(_required_path(request), request.image_size)
    assert callable(source)
    return sample_shape(source(request).x_train.shape, request.dataset)


def load_dataset(
    name: str, data_dir: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> Dataset:
    """Load both splits of a registered dataset, normalised with the registry's mean/std.

    ``env`` defaults to ``os.environ``; tests pass their own mapping.
    """
    return load_data(DataRequest(dataset=name, dir=str(data_dir or "")), env)
