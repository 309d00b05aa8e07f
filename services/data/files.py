"""Validated readers for the two on-disk formats: ``.npz`` archives and IDX files.

``.npz``: an image array and a label array under known keys; ``allow_pickle=False`` always, so
an ``.npz`` with object arrays is refused, never unpickled.

IDX, the format of the original MNIST / Fashion-MNIST releases: two zero bytes, a type code,
the number of dimensions ``nd``, then ``nd`` big-endian uint32 sizes, then the data in
row-major order. Files may be gzip-compressed (detected by the gzip magic, not by the name).
Every header field is checked against the file length so a truncated or foreign file fails
with a message saying which field is wrong, instead of a reshape error deep inside numpy.
"""

from __future__ import annotations

import gzip
import struct
import zipfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from services.data.errors import DataFormatError


def npz_arrays(path: str | Path, keys: Sequence[str]) -> dict[str, npt.NDArray[Any]]:
    """The arrays ``keys`` of an ``.npz`` archive (``DataFormatError`` naming what it holds when
    one is missing)."""
    path = Path(path)
    try:
        # We open the file ourselves: np.load leaks its own handle when the zip is corrupt.
        with path.open("rb") as handle:
            archive = np.load(handle, allow_pickle=False)
            if not isinstance(archive, np.lib.npyio.NpzFile):
                raise DataFormatError(path, "not an .npz archive (a bare .npy array?)")
            with archive:
                missing = [k for k in keys if k not in archive.files]
                if missing:
                    raise DataFormatError(
                        path, f"missing array(s) {missing}; the file holds {sorted(archive.files)}"
                    )
                return {k: archive[k] for k in keys}
    except DataFormatError:
        raise
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as exc:
        # ValueError covers "object arrays need allow_pickle", malformed .npy headers and files
        # that are neither .npz nor .npy (numpy then assumes a pickle and refuses it).
        raise DataFormatError(path, f"cannot read .npz: {exc}") from exc


def npz_keys(path: str | Path) -> list[str]:
    """The array names in an ``.npz`` archive, without reading the arrays."""
    try:
        with zipfile.ZipFile(path) as archive:
            return [n.removesuffix(".npy") for n in archive.namelist()]
    except (OSError, zipfile.BadZipFile) as exc:
        raise DataFormatError(path, f"cannot read .npz: {exc}") from exc


def npz_shape(path: str | Path, key: str) -> tuple[int, ...]:
    """The shape of array ``key`` of an ``.npz`` archive, read from its header alone."""
    try:
        with zipfile.ZipFile(path) as archive, archive.open(f"{key}.npy") as member:
            version = np.lib.format.read_magic(member)
            if version == (1, 0):
                shape, _, _ = np.lib.format.read_array_header_1_0(member)
            else:
                shape, _, _ = np.lib.format.read_array_header_2_0(member)
    except KeyError:
        raise DataFormatError(path, f"missing array {key!r}") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise DataFormatError(path, f"cannot read .npz: {exc}") from exc
    return tuple(int(d) for d in shape)


def read_npz(
    path: str | Path, x_key: str = "x", y_key: str = "y"
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.integer]]:
    """Return ``(x, y)``: uint8 images [N,H,W] or [N,H,W,C] and integer labels [N]."""
    arrays = npz_arrays(path, (x_key, y_key))
    x, y = arrays[x_key], arrays[y_key]
    if x.dtype != np.uint8 or x.ndim not in (3, 4):
        raise DataFormatError(path, f"expected uint8 images [N,H,W(,C)], got {x.dtype} {x.shape}")
    if not np.issubdtype(y.dtype, np.integer) or y.ndim != 1:
        raise DataFormatError(path, f"expected integer labels [N], got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataFormatError(path, f"{len(y)} labels for {len(x)} images")
    return x, y


_GZIP_MAGIC = b"\x1f\x8b"
_MAX_DIMS = 8

# IDX type code -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, str] = {
    0x08: "u1",
    0x09: "i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


def parse_idx(data: bytes, source: object = "<bytes>") -> npt.NDArray[np.generic]:
    """Decode one IDX payload (already decompressed); ``source`` only names it in errors."""
    if len(data) < 4:
        raise DataFormatError(source, f"too short for an IDX header ({len(data)} bytes)")
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0:
        raise DataFormatError(
            source, f"bad IDX magic 0x{data[:4].hex()}: the first two bytes must be zero"
        )
    if code not in _IDX_DTYPES:
        raise DataFormatError(source, f"unknown IDX type code 0x{code:02x}")
    if not 1 <= ndim <= _MAX_DIMS:
        raise DataFormatError(source, f"IDX header declares {ndim} dimensions (1..{_MAX_DIMS})")
    header_len = 4 + 4 * ndim
    if len(data) < header_len:
        raise DataFormatError(source, f"truncated IDX header: {ndim} dims need {header_len} bytes")
    shape = struct.unpack(f">{ndim}I", data[4:header_len])
    dtype = np.dtype(_IDX_DTYPES[code])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    actual = len(data) - header_len
    if actual != expected:
        raise DataFormatError(
            source,
            f"IDX header declares shape {shape} of {dtype} ({expected} bytes) "
            f"but the file holds {actual} data bytes",
        )
    # astype copies into a writable, native-endian array (torch.from_numpy needs both).
    array = np.frombuffer(data, dtype=dtype, offset=header_len).reshape(shape)
    return array.astype(dtype.newbyteorder("="))


def read_idx(path: str | Path) -> npt.NDArray[np.generic]:
    """Read an IDX file (raw or gzip) into a native-endian numpy array."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise DataFormatError(path, f"cannot read file: {exc.strerror or exc}") from exc
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise DataFormatError(path, f"corrupt gzip stream: {exc}") from exc
    return parse_idx(raw, path)


def read_idx_pair(
    images: str | Path, labels: str | Path
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Read an images/labels pair and check they fit together: uint8 [N,H,W] and uint8 [N]."""
    x = read_idx(images)
    y = read_idx(labels)
    if x.dtype != np.uint8 or x.ndim != 3:
        raise DataFormatError(images, f"expected uint8 images [N,H,W], got {x.dtype} {x.shape}")
    if y.dtype != np.uint8 or y.ndim != 1:
        raise DataFormatError(labels, f"expected uint8 labels [N], got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise DataFormatError(labels, f"{len(y)} labels for {len(x)} images in {images}")
    return x.astype(np.uint8, copy=False), y.astype(np.uint8, copy=False)
