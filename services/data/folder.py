"""`[data] dataset = "image_folder"`: PNG/JPEG images in one folder per class, read with Pillow.

Layout (docs/data.md, "image_folder"): ``DIR/train/<class>/*.png`` and ``DIR/test/<class>/*``;
without a ``test`` folder a seeded `test_fraction` of ``train`` is held out, and without a
``train`` folder the classes are ``DIR/<class>/`` directly. Classes are the sorted folder names
of the training split (label 0 is the first); a test class the training split lacks is
refused. Images are read in sorted file order, as single-channel ("L") when every one of them
is grayscale and as RGB otherwise (alpha dropped). All must have one size, unless `image_size`
resizes every image to a square of that side.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from services.data.arrays import LabelledArrays, hold_out
from services.data.errors import DataFormatError, DatasetNotFoundError

SUFFIXES = frozenset({".png", ".jpg", ".jpeg"})
# Modes that hold no colour: such images become "L"; any other mode makes the dataset RGB.
_GRAY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})


@dataclass(frozen=True)
class Listing:
    """The image files of both splits, each with its label, and the class names."""

    classes: tuple[str, ...]
    train: tuple[tuple[Path, int], ...]
    test: tuple[tuple[Path, int], ...] | None
    """None: no test folder (the caller holds part of ``train`` out)."""


def _class_files(split_dir: Path) -> dict[str, list[Path]]:
    folders = sorted(p for p in split_dir.iterdir() if p.is_dir())
    return {
        folder.name: sorted(
            p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in SUFFIXES
        )
        for folder in folders
    }


def list_folder(root: Path) -> Listing:
    """What `root` holds, checked: at least two classes, each with images."""
    if not root.is_dir():
        raise DatasetNotFoundError(f"image folder {root} does not exist (data.path)")
    train_dir = root / "train" if (root / "train").is_dir() else root
    by_class = _class_files(train_dir)
    if len(by_class) < 2:
        raise DataFormatError(
            train_dir,
            f"found {len(by_class)} class folder(s): expected one folder of images per class "
            "(at least two), e.g. train/cat/*.png and train/dog/*.png",
        )
    empty = [name for name, files in by_class.items() if not files]
    if empty:
        raise DataFormatError(
            train_dir / empty[0], f"no {'/'.join(sorted(SUFFIXES))} images in this class folder"
        )
    classes = tuple(by_class)
    train = tuple((p, label) for label, files in enumerate(by_class.values()) for p in files)
    test_dir = root / "test"
    if train_dir == root or not test_dir.is_dir():
        return Listing(classes, train, None)
    test_by_class = _class_files(test_dir)
    unknown = sorted(set(test_by_class) - set(classes))
    if unknown:
        raise DataFormatError(
            test_dir / unknown[0], f"test class {unknown[0]!r} has no training folder"
        )
    index = {name: label for label, name in enumerate(classes)}
    test = tuple((p, index[name]) for name, files in test_by_class.items() for p in files)
    return Listing(classes, train, test)


def _survey(files: Sequence[Path], image_size: int) -> tuple[str, tuple[int, int]]:
    """The mode every image is converted to and the (width, height) they all have."""
    gray = True
    size: tuple[int, int] | None = (image_size, image_size) if image_size else None
    first: Path | None = None
    for path in files:
        with _open(path) as image:  # reads the header only
            gray = gray and image.mode in _GRAY_MODES
            if image_size:
                continue
            if size is None:
                size, first = image.size, path
            elif image.size != size:
                raise DataFormatError(
                    path,
                    f"image is {image.size[0]}x{image.size[1]} but {first} is "
                    f"{size[0]}x{size[1]}: every image must have one size; set "
                    "[data] image_size to resize them all to a square",
                )
    assert size is not None  # files is never empty (list_folder)
    return ("L" if gray else "RGB"), size


def _open(path: Path) -> Image.Image:
    try:
        return Image.open(path)
    except (OSError, UnidentifiedImageError) as exc:
        raise DataFormatError(path, f"cannot read image: {exc}") from exc


def _decode(files: Sequence[Path], mode: str, size: tuple[int, int]) -> np.ndarray:
    out = np.empty((len(files), size[1], size[0], *(() if mode == "L" else (3,))), np.uint8)
    for i, path in enumerate(files):
        with _open(path) as image:
            try:
                picture = image.convert(mode)
                if picture.size != size:
                    picture = picture.resize(size, Image.Resampling.BILINEAR)
                out[i] = np.asarray(picture)
            except OSError as exc:  # a truncated file fails on decoding, not on opening
                raise DataFormatError(path, f"cannot decode image: {exc}") from exc
    return out


def read_image_folder(
    root: Path, *, image_size: int, test_fraction: float, seed: int
) -> LabelledArrays:
    """Both splits of the folder (see the module docstring) as uint8 images and labels."""
    listing = list_folder(root)
    everything = [p for p, _ in (*listing.train, *(listing.test or ()))]
    mode, size = _survey(everything, image_size)

    def arrays(pairs: Sequence[tuple[Path, int]]) -> tuple[np.ndarray, np.ndarray]:
        x = _decode([p for p, _ in pairs], mode, size)
        return x, np.array([label for _, label in pairs], dtype=np.int64)

    x, y = arrays(listing.train)
    if listing.test is None:
        splits = hold_out(x, y, test_fraction, seed, root)
    else:
        splits = (x, y, *arrays(listing.test))
    return LabelledArrays(*splits, class_names=listing.classes)


def image_folder_shape(root: Path, image_size: int) -> tuple[int, ...]:
    """One sample's (C, H, W), from the image headers alone."""
    listing = list_folder(root)
    everything = [p for p, _ in (*listing.train, *(listing.test or ()))]
    mode, (width, height) = _survey(everything, image_size)
    return (1 if mode == "L" else 3, height, width)
