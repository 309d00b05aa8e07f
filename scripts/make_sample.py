r"""Build the Fashion-MNIST sample shipped in ``services/data/sample/``: a tool that made a data
file, not part of the product (nothing at run time reads the source), so it lives here.

The committed file was made from the bit-exact official Fashion-MNIST arrays
(``/work/shared/data/fashion_mnist_{train,test}.npz``, see that folder's README for their
provenance; MIT licence, (c) 2017 Zalando SE) with the defaults below::

    python -m scripts.make_sample /work/shared/data \
        services/data/sample/fashion_mnist_sample.npz

It holds a class-balanced subset, 600 train and 100 test images per class, drawn without
replacement with ``numpy.random.default_rng(0)`` and kept in the original order. Arrays:
``x_train`` uint8 [6000,28,28], ``y_train`` uint8 [6000], ``x_test`` uint8 [1000,28,28],
``y_test`` uint8 [1000], and ``train_index`` / ``test_index`` (int32): the position of each
sample in the official split, so the sample can be checked against its source.
"""

from __future__ import annotations

from pathlib import Path

import click
import numpy as np
import numpy.typing as npt

from services.data.loaders import load_split_arrays
from services.data.registry import get_spec


def balanced_indices(
    labels: npt.NDArray[np.integer], per_class: int, rng: np.random.Generator
) -> npt.NDArray[np.int32]:
    """``per_class`` random indices of every class present, sorted (dataset order kept)."""
    chosen = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        if len(members) < per_class:
            raise ValueError(f"class {c} has {len(members)} samples, fewer than {per_class}")
        chosen.append(rng.choice(members, size=per_class, replace=False))
    return np.sort(np.concatenate(chosen)).astype(np.int32)


def build_sample(
    source_dir: str | Path,
    out: str | Path,
    *,
    per_class_train: int = 600,
    per_class_test: int = 100,
    seed: int = 0,
) -> Path:
    """Write the sample ``.npz`` to ``out`` from the full Fashion-MNIST in ``source_dir``."""
    spec = get_spec("fashion_mnist")
    rng = np.random.default_rng(seed)
    x_train, y_train = load_split_arrays(spec, "train", source_dir)
    x_test, y_test = load_split_arrays(spec, "test", source_dir)
    # Train first, then test, from one generator: the order is part of the recipe.
    train_index = balanced_indices(y_train, per_class_train, rng)
    test_index = balanced_indices(y_test, per_class_test, rng)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        out,
        x_train=x_train[train_index],
        y_train=y_train[train_index].astype(np.uint8),
        x_test=x_test[test_index],
        y_test=y_test[test_index].astype(np.uint8),
        train_index=train_index,
        test_index=test_index,
    )
    return out


@click.command()
@click.argument("source_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--per-class-train", default=600, show_default=True)
@click.option("--per-class-test", default=100, show_default=True)
@click.option("--seed", default=0, show_default=True)
def main(source_dir: Path, out: Path, per_class_train: int, per_class_test: int, seed: int) -> None:
    """Write a class-balanced Fashion-MNIST sample from SOURCE_DIR to OUT."""
    path = build_sample(
        source_dir, out, per_class_train=per_class_train, per_class_test=per_class_test, seed=seed
    )
    click.echo(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
