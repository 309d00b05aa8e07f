"""Reader for ``.npz`` image files: an image array and a label array under known keys.

``allow_pickle=False`` always: an ``.npz`` with object arrays is refused, never unpickled.
"""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path

import numpy as np
import numpy.typing as npt

from services.data.errors import DataFormatError


def read_npz(
    path: str | Path, x_key: str = "x", y_key: str = "y"
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.integer]]:
    """Return ``(x, y)``: uint8 images [N,H,W] or [N,H,W,C] and integer labels [N]."""
    path = Path(path)
    try:
        # We open the file ourselves: np.load leaks its own handle when the zip is corrupt.
        with path.open("rb") as handle:
            archive = np.load(handle, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise DataFormatError(path, "not an .npz archive (a bare .npy array?)")
            with archive:
                missing = [k for k in (x_key, y_key) if k not in archive.files]
                if missing:
                    raise DataFormatError(
                        path, f"missing array(s) {missing}; the file holds {sorted(archive.files)}"
                    )
                x = archive[x_key]
                y = archive[y_key]
    except DataFormatError:
        raise
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
        # ValueError covers "object arrays need allow_pickle", malformed .npy headers and files
        # that are neither .npz nor .npy (numpy then assumes a pickle and refuses it).
        raise DataFormatError(path, f"cannot read .npz: {exc}") from exc
    _check_pair(path, x, y)
    return x, y


def _check_pair(path: Path, x: npt.NDArray[np.generic], y: npt.NDArray[np.generic]) -> None:
    if x.dtype != np.uint8 or x.ndim not in (3, 4):
        raise DataFormatError(path, f"expected uint8 images [N,H,W(,C)], got {x.dtype} {x.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataFormatError(path, f"expected integer labels [N], got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataFormatError(path, f"{len(y)} labels for {len(x)} images")
