"""Tensors on the wire: the dtype whitelist, the `{dtype, shape, data}` header map, zero-copy
views into a received body and a cheap finite check.

A tensor's bytes never pass through msgpack (which copies bin payloads on pack and unpack): the
header map's `data` is an ext value naming `(offset, nbytes)` in the body's data section, and
`codec` lays the raw bytes out there. Everything is little-endian, as on every host we target.
"""

from __future__ import annotations

import math
import re
import struct
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, cast

import msgpack
import numpy as np
import torch

from broker.errors import DecodeError

# Tensor data starts at multiples of this from the start of the data section, so a receiver may
# read any dtype (and SIMD loads) aligned when the body itself is 64-byte aligned.
ALIGN = 64
# msgpack ext type code of a tensor's `data` reference; the payload is `_REF` (offset, nbytes).
TENSOR_EXT_CODE = 1
_REF = struct.Struct("<QQ")
_HEADER_KEYS = frozenset({"dtype", "shape", "data"})


@dataclass(frozen=True, slots=True)
class WireDtype:
    """A whitelisted dtype: its wire name, torch dtype and the numpy dtype its bytes ride in."""

    name: str
    torch_dtype: torch.dtype
    # numpy has no bfloat16, so it rides as int16; bool rides as uint8 so it can be checked for
    # bytes other than 0/1 before torch sees it.
    carrier: np.dtype[np.generic]
    itemsize: int


def _wire(name: str, torch_dtype: torch.dtype, carrier: str) -> WireDtype:
    return WireDtype(name, torch_dtype, np.dtype(carrier), torch_dtype.itemsize)


WIRE_DTYPES: Mapping[str, WireDtype] = MappingProxyType(
    {
        d.name: d
        for d in (
            _wire("float64", torch.float64, "<f8"),
            _wire("float32", torch.float32, "<f4"),
            _wire("float16", torch.float16, "<f2"),
            _wire("bfloat16", torch.bfloat16, "<i2"),
            _wire("int64", torch.int64, "<i8"),
            _wire("int32", torch.int32, "<i4"),
            _wire("int16", torch.int16, "<i2"),
            _wire("int8", torch.int8, "i1"),
            _wire("uint8", torch.uint8, "u1"),
            _wire("bool", torch.bool, "u1"),
        )
    }
)
_BY_TORCH: Mapping[torch.dtype, WireDtype] = MappingProxyType(
    {d.torch_dtype: d for d in WIRE_DTYPES.values()}
)


def align(n: int) -> int:
    """`n` rounded up to a multiple of `ALIGN`."""
    return -(-n // ALIGN) * ALIGN


def wire_dtype(dtype: torch.dtype) -> WireDtype | None:
    """The whitelisted wire dtype of a torch dtype, or None if it may not travel."""
    return _BY_TORCH.get(dtype)


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """A tensor as the header describes it, checked for consistency but not yet materialised."""

    path: str
    dtype: WireDtype
    shape: tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int


def tensor_header(
    dtype: WireDtype, shape: tuple[int, ...], offset: int, nbytes: int
) -> dict[str, object]:
    """The header map of one tensor whose bytes lie at `offset` of the data section."""
    return {
        "dtype": dtype.name,
        "shape": list(shape),
        "data": msgpack.ExtType(TENSOR_EXT_CODE, _REF.pack(offset, nbytes)),
    }


def parse_tensor_header(obj: object, path: str, *, max_rank: int, max_dim: int) -> TensorSlot:
    """Check one decoded header map; raises `DecodeError` naming `path` on any inconsistency.

    Only Python integers are involved, so a shape claiming 10^12 elements costs nothing.
    """
    if not isinstance(obj, dict):
        raise DecodeError(f"{path}: expected a tensor map, got {type(obj).__name__}")
    if obj.keys() != _HEADER_KEYS:
        found = sorted(str(k) for k in obj)
        raise DecodeError(f"{path}: tensor map needs keys ['data', 'dtype', 'shape'], has {found}")
    name = obj["dtype"]
    dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        raise DecodeError(f"{path}: dtype {name!r} is not allowed (allowed: {sorted(WIRE_DTYPES)})")
    shape = _parse_shape(obj["shape"], path, max_rank=max_rank, max_dim=max_dim)
    offset, nbytes = _parse_ref(obj["data"], path)
    needed = math.prod(shape) * dtype.itemsize
    if needed != nbytes:
        raise DecodeError(f"{path}: shape {list(shape)} needs {needed} bytes, data has {nbytes}")
    return TensorSlot(path, dtype, shape, offset, nbytes)


def _parse_shape(obj: object, path: str, *, max_rank: int, max_dim: int) -> tuple[int, ...]:
    if not isinstance(obj, list):
        raise DecodeError(f"{path}: shape must be a list, got {type(obj).__name__}")
    if len(obj) > max_rank:
        raise DecodeError(f"{path}: rank {len(obj)} exceeds the limit of {max_rank}")
    for dim in obj:
        # bool is an int subclass; a shape of [True] is garbage, not [1].
        if type(dim) is not int:
            raise DecodeError(f"{path}: shape {obj!r} holds a non-integer dimension")
        if dim < 0 or dim > max_dim:
            raise DecodeError(f"{path}: dimension {dim} of shape {obj!r} is out of [0, {max_dim}]")
    return tuple(obj)


def _parse_ref(obj: object, path: str) -> tuple[int, int]:
    if not isinstance(obj, msgpack.ExtType) or obj.code != TENSOR_EXT_CODE:
        raise DecodeError(f"{path}: data must be a tensor reference, msgpack ext {TENSOR_EXT_CODE}")
    if len(obj.data) != _REF.size:
        raise DecodeError(
            f"{path}: tensor reference has {len(obj.data)} bytes, expected {_REF.size}"
        )
    offset, nbytes = _REF.unpack(obj.data)
    return int(offset), int(nbytes)


def to_wire(tensor: torch.Tensor) -> torch.Tensor:
    """A detached, CPU, contiguous tensor (the input itself when it already is one)."""
    return tensor.detach().cpu().contiguous()


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a `to_wire` tensor, sharing its memory."""
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.numpy().reshape(-1).view(np.uint8).data


def copy_into(buffer: bytearray, start: int, tensor: torch.Tensor) -> None:
    """Copy `tensor` (any device, any strides) into `buffer[start:]` in one pass."""
    if tensor.numel() == 0:
        return
    dst = torch.frombuffer(buffer, dtype=torch.uint8, count=tensor.nbytes, offset=start)
    # One torch copy handles strides, devices and bfloat16 and runs on torch's thread pool.
    dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())


@contextmanager
def sharing_read_only() -> Iterator[None]:
    """Silence torch's warning about tensors over non-writable memory, and only that one.

    Decoded tensors are views of an immutable body on purpose; enter this once around all the
    `view_from` calls of a body (entering it costs more than a view). Like every use of
    `warnings.catch_warnings`, it is not thread-safe with respect to other warning filters.
    """
    with warnings.catch_warnings():
        # What `warnings.filterwarnings` would insert, prebuilt: its validation, regex lookup
        # and duplicate scan cost three times the rest. The list is catch_warnings' own copy.
        cast("list[object]", warnings.filters).insert(0, _IGNORE_NOT_WRITABLE)
        yield


_IGNORE_NOT_WRITABLE = (
    "ignore",
    re.compile("The given NumPy array is not writable", re.IGNORECASE),
    UserWarning,
    None,
    0,
)


def view_from(body: memoryview, start: int, slot: TensorSlot) -> torch.Tensor:
    """A zero-copy tensor over `body[start + slot.offset:]`; checks bool bytes are 0 or 1.

    Call inside `sharing_read_only()` when `body` is read-only. torch cannot mark a tensor
    read-only: callers that modify decoded tensors in place must clone them first.
    """
    count = slot.nbytes // slot.dtype.itemsize
    array = np.frombuffer(body, dtype=slot.dtype.carrier, count=count, offset=start + slot.offset)
    tensor = torch.from_numpy(array.reshape(slot.shape))
    if slot.dtype.torch_dtype == torch.bool:
        if count and int(tensor.max()) > 1:
            raise DecodeError(f"{slot.path}: bool tensor holds bytes other than 0 and 1")
        return tensor.view(torch.bool)
    if tensor.dtype != slot.dtype.torch_dtype:
        return tensor.view(slot.dtype.torch_dtype)
    return tensor


def all_finite(tensor: torch.Tensor) -> bool:
    """True unless a floating-point tensor holds NaN or ±inf.

    CPU tensors are scanned by numpy on the calling thread, never by torch: torch splits a
    large scan over its OpenMP pool, and on a host also busy with RabbitMQ and the other end of
    the link, that pool's barrier and spinning threads cost far more than the scan (1.5 MiB:
    0.05 ms idle, 20+ ms on a loaded 2-core host; see docs/benchmarks.md). float32/64 use
    numpy's SIMD `isfinite`; 16-bit floats, which numpy scans slowly or lacks, are tested on
    their bits: NaN and ±inf are exactly the values whose exponent bits are all ones. Other
    devices use one `aminmax` (NaN propagates, an infinity is an extreme).
    """
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    tensor = tensor.detach()
    if tensor.is_cpu:
        if tensor.dtype in _NUMPY_FLOATS:
            return _chunks_all(tensor.numpy().reshape(-1), _finite_chunk)
        exponent = _EXPONENT_BITS.get(tensor.dtype)
        if exponent is not None:
            bits = tensor.view(torch.int16).numpy().view(np.uint16).reshape(-1)
            return _chunks_all(bits, lambda part, buf: _exponent_chunk(part, buf, exponent))
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


# Scanned in chunks through one small scratch buffer: a whole-tensor temporary (16 MiB of
# float32 makes a 4 MiB mask) costs fresh pages on every call, more than the scan itself.
_CHUNK = 1 << 16


def _chunks_all(
    flat: np.ndarray[Any, Any], check: Callable[[np.ndarray[Any, Any], np.ndarray[Any, Any]], bool]
) -> bool:
    buf = np.empty(min(_CHUNK, flat.size), dtype=np.uint16 if flat.dtype == np.uint16 else bool)
    for start in range(0, flat.size, _CHUNK):
        part = flat[start : start + _CHUNK]
        if not check(part, buf[: part.size]):
            return False
    return True


def _finite_chunk(part: np.ndarray[Any, Any], buf: np.ndarray[Any, Any]) -> bool:
    np.isfinite(part, out=buf)
    return bool(buf.all())


def _exponent_chunk(part: np.ndarray[Any, Any], buf: np.ndarray[Any, Any], exponent: int) -> bool:
    np.bitwise_and(part, 0x7FFF, out=buf)
    return int(buf.max()) < exponent


_NUMPY_FLOATS = frozenset({torch.float32, torch.float64})
# The exponent field of the 16-bit floats; with the sign cleared, a value is NaN or ±inf
# exactly when its bits are at least this.
_EXPONENT_BITS: Mapping[torch.dtype, int] = MappingProxyType(
    {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
)
