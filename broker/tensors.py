"""Tensors on the wire (docs/architecture.md, "Messages on the wire"): the dtype whitelist,
the `{dtype, shape, data}` header map, zero-copy views into a received body, the finite check.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, SimpleNamespace
from typing import Any, NamedTuple, NoReturn

import msgpack
import numpy as np
import torch

from broker.errors import DecodeError

ALIGN = 64  # tensor data starts at multiples of this from the start of the data section
# msgpack ext type code of a tensor's `data` reference; the payload is `REF` (offset, nbytes).
TENSOR_EXT_CODE = 1
REF = struct.Struct("<QQ")
# A tensor's header map: `{"dtype": name, "shape": [dims], "data": ext TENSOR_EXT_CODE}`, written
# and read by `broker.codec_schema`'s Writer and Reader.
HEADER_KEYS = frozenset({"dtype", "shape", "data"})


@dataclass(frozen=True, slots=True)
class FloatBits:
    """How to find NaN and ±inf of one float format on its bits, without writing anything.

    A value is NaN or ±inf exactly when its exponent bits are all ones. Read as a signed
    integer, a value with the sign bit clear is NaN or +inf iff it is >= `positive` (the bits
    of +inf), and no other value is larger; read as an unsigned integer, a value with the sign
    bit set is NaN or -inf iff it is >= `negative` (the bits of -inf), and no other value is
    larger. So an array is finite iff max(signed view) < positive and max(unsigned view) <
    negative: two vectorised integer reductions, at any strides, with no temporary.
    """

    signed: np.dtype[np.generic]
    unsigned: np.dtype[np.generic]
    positive: int
    negative: int
    # The numpy float dtype when numpy's own `isfinite` is fast for it (float32, float64): for
    # arrays small enough to sit in the core's cache, one pass writing a bool mask beats two
    # full reads (100 KiB: ~3.4 vs ~4.7 us). numpy's float16 isfinite is ten times slower.
    native: np.dtype[np.generic] | None


@dataclass(frozen=True, slots=True)
class WireDtype:
    """A whitelisted dtype: its wire name, torch dtype and the numpy dtype its bytes ride in."""

    name: str
    torch_dtype: torch.dtype
    # numpy has no bfloat16, so it rides as int16; bool rides as uint8 so it can be checked for
    # bytes other than 0/1 before torch sees it.
    carrier: np.dtype[np.generic]
    itemsize: int
    bits: FloatBits | None  # floating-point formats only
    # The dtype a tensor over the carrier must be viewed as (bfloat16, bool), else None.
    view_as: torch.dtype | None


def _wire(name: str, torch_dtype: torch.dtype, carrier: str, infinity: int = 0) -> WireDtype:
    """`infinity`: the bits of +inf, for floats."""
    size = torch_dtype.itemsize
    bits = None
    if infinity:
        native = np.dtype(carrier) if torch_dtype in (torch.float32, torch.float64) else None
        sign = 1 << (8 * size - 1)
        bits = FloatBits(
            np.dtype(f"<i{size}"), np.dtype(f"<u{size}"), infinity, sign | infinity, native
        )
    view_as = torch_dtype if torch_dtype in (torch.bfloat16, torch.bool) else None
    return WireDtype(name, torch_dtype, np.dtype(carrier), size, bits, view_as)


WIRE_DTYPES: Mapping[str, WireDtype] = MappingProxyType(
    {
        d.name: d
        for d in (
            _wire("float64", torch.float64, "<f8", 0x7FF0_0000_0000_0000),
            _wire("float32", torch.float32, "<f4", 0x7F80_0000),
            _wire("float16", torch.float16, "<f2", 0x7C00),
            _wire("bfloat16", torch.bfloat16, "<i2", 0x7F80),
            _wire("int64", torch.int64, "<i8"),
            _wire("int32", torch.int32, "<i4"),
            _wire("int16", torch.int16, "<i2"),
            _wire("int8", torch.int8, "i1"),
            _wire("uint8", torch.uint8, "u1"),
            _wire("bool", torch.bool, "u1"),
        )
    }
)
# The wire dtype of each torch dtype that may travel.
BY_TORCH: Mapping[torch.dtype, WireDtype] = MappingProxyType(
    {d.torch_dtype: d for d in WIRE_DTYPES.values()}
)


def align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class TensorSlot(NamedTuple):
    """A tensor as the header describes it, checked for consistency but not yet materialised."""

    path: str
    dtype: WireDtype
    shape: tuple[int, ...]
    offset: int  # from the start of the data section
    nbytes: int


def unpack_ext(code: int, data: bytes) -> object:
    """msgpack's `ext_hook` for headers: a well-formed tensor reference becomes its `(offset,
    nbytes)` tuple (msgpack makes no other tuples: arrays become lists); any other ext value
    stays an ExtType, for `ref_problem` to say what is wrong with it."""
    if code == TENSOR_EXT_CODE and len(data) == REF.size:
        return REF.unpack(data)
    return msgpack.ExtType(code, data)


def shape_reason(obj: object, path: str, *, max_rank: int, max_dim: int) -> str:
    """What is wrong with a shape (a header's, or an encoded tensor's as a list) that its
    caller found at fault."""
    if not isinstance(obj, list):
        return f"{path}: shape must be a list, got {type(obj).__name__}"
    if len(obj) > max_rank:
        return f"{path}: rank {len(obj)} exceeds the limit of {max_rank}"
    for dim in obj:
        if type(dim) is not int:
            return f"{path}: shape {obj!r} holds a non-integer dimension"
        if dim < 0 or dim > max_dim:
            return f"{path}: dimension {dim} of shape {obj!r} is out of [0, {max_dim}]"
    raise AssertionError(f"{path}: shape {obj!r} has no problem")  # callers saw one


def ref_problem(obj: object, path: str) -> NoReturn:
    """Raise what is wrong with a tensor map's `data`, which is not a well-formed reference."""
    if isinstance(obj, msgpack.ExtType) and obj.code == TENSOR_EXT_CODE:
        raise DecodeError(
            f"{path}: tensor reference has {len(obj.data)} bytes, expected {REF.size}"
        )
    raise DecodeError(f"{path}: data must be a tensor reference, msgpack ext {TENSOR_EXT_CODE}")


def host_array(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """A numpy array sharing a CPU tensor's memory and strides (bfloat16 as int16)."""
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy()  # a dtype view never tracks gradients
    return (tensor.detach() if tensor.requires_grad else tensor).numpy()


def copy_checked(
    dst: np.ndarray[Any, np.dtype[np.uint8]],
    tensor: torch.Tensor,
    host: np.ndarray[Any, Any] | None,
    finite: FloatBits | None,
) -> bool:
    """Copy `tensor`'s wire bytes into `dst` (uint8, exactly `tensor.nbytes` long); with
    `finite`, also check them for NaN and ±inf and return False if there are any.

    A contiguous CPU tensor (`host`: its `host_array`) is copied in `_CHUNK`-byte pieces, each
    checked while still in the core's cache (docs/benchmarks.md, codec section); others take
    one torch copy (strides, devices, bfloat16) and a check of the copy.
    """
    if host is not None and host.flags.c_contiguous:
        source = host.reshape(-1).view(np.uint8)
        for start in range(0, dst.size, _CHUNK):
            piece = dst[start : start + _CHUNK]
            np.copyto(piece, source[start : start + _CHUNK])
            if finite is not None and not finite_array(piece.view(host.dtype), finite):
                return False
        return True
    copy = torch.from_numpy(dst).view(tensor.dtype).view(tensor.shape)
    copy.copy_(tensor.detach())
    return finite is None or all_finite(copy)


def writable_alias(buffer: bytes | memoryview) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """A writable uint8 array over a (read-only) contiguous buffer's memory, keeping it alive.
    Writing through it is the caller's promise: only a body nobody else has seen yet.

    The decoder passes a received `bytes` body through it for `view_from`: torch has no
    read-only tensors (over a read-only array `torch.from_numpy` makes a writable tensor anyway,
    and warns), and decoded tensors are views of the body on purpose, so the alias does what
    torch would, without the warning and without touching a warning filter (right on every
    thread, free-threaded builds included).
    """
    # The buffer protocol's own address for the storage: no assumption about its layout.
    address: int = np.frombuffer(buffer, np.uint8).__array_interface__["data"][0]
    interface = {"data": (address, False), "shape": (len(buffer),), "typestr": "|u1", "version": 3}
    # numpy keeps the namespace as the array's base, and the namespace keeps `buffer` alive.
    return np.asarray(SimpleNamespace(__array_interface__=interface, owner=buffer))


def view_from(
    body: memoryview, start: int, slot: TensorSlot, *, finite: bool = False
) -> torch.Tensor:
    """A zero-copy tensor over `body[start + slot.offset:]` (a fresh one when empty), its bool
    bytes and, when `finite`, its floats checked (`DecodeError` naming the slot's path). Pass a
    read-only `body` through `writable_alias` first."""
    dtype = slot.dtype
    if not slot.nbytes:  # may lie past the end of a body without a data section
        return torch.empty(slot.shape, dtype=dtype.torch_dtype)
    array: np.ndarray[Any, Any] = np.ndarray(slot.shape, dtype.carrier, body, start + slot.offset)
    # Checked on the array, before torch sees it: no tensor-to-numpy round trip per call.
    if finite and dtype.bits is not None and not finite_array(array, dtype.bits):
        raise DecodeError(f"{slot.path}: holds NaN or infinite values")
    tensor = torch.from_numpy(array)
    view_as = dtype.view_as
    if view_as is None:
        return tensor
    if view_as is torch.bool and int(_MAX(array, axis=None)) > 1:
        raise DecodeError(f"{slot.path}: bool tensor holds bytes other than 0 and 1")
    return tensor.view(view_as)


def all_finite(tensor: torch.Tensor) -> bool:
    """True unless a floating-point tensor holds NaN or ±inf.

    CPU tensors of the wire's float dtypes are scanned by numpy on the calling thread, never by
    torch, whose OpenMP pool stalls for tens of ms on a loaded host (docs/benchmarks.md, round
    trip section). Other devices and dtypes: one `aminmax` (NaN propagates, inf is an extreme).
    """
    wire = BY_TORCH.get(tensor.dtype)
    bits = None if wire is None else wire.bits
    if bits is not None and tensor.is_cpu:
        return tensor.numel() == 0 or finite_array(host_array(tensor), bits)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor.detach())
    return math.isfinite(float(low)) and math.isfinite(float(high))


def finite_array(array: np.ndarray[Any, Any], bits: FloatBits) -> bool:
    """True unless non-empty `array`, whose items are floats of `bits`' format in a carrier of
    the same width (any strides), holds NaN or ±inf.

    Small float32/64 arrays go through numpy's `isfinite` (see `FloatBits.native`); the rest
    through `FloatBits`' two reductions, contiguous ones in `_CHUNK`-byte pieces so that the
    second reduction reads what the first just brought into the core's cache (~25% faster
    than two whole passes once the array outgrows the shared cache; slower below `_CHUNK`,
    where one pair of calls costs less than slicing).
    """
    size = array.nbytes
    native = bits.native
    if size <= _SMALL and native is not None:
        # Callers pass the float carrier itself (the decoder's, `host_array`'s); only another
        # carrier needs a view.
        floats = array if array.dtype is native else array.view(native)
        return bool(_ALL(np.isfinite(floats), axis=None))
    if size <= _CHUNK or not array.flags.c_contiguous:
        return _finite_bits(array, bits)
    flat = array.reshape(-1)
    step = _CHUNK // array.itemsize
    return all(_finite_bits(flat[i : i + step], bits) for i in range(0, flat.size, step))


def _finite_bits(array: np.ndarray[Any, Any], bits: FloatBits) -> bool:
    return bool(
        _MAX(array.view(bits.signed), axis=None) < bits.positive
        and _MAX(array.view(bits.unsigned), axis=None) < bits.negative
    )


_MAX = np.maximum.reduce
_ALL = np.logical_and.reduce
# Half a core's L2 cache (1 MiB on the Zen 4 hosts measured; 1-2 MiB on current x86), so a
# piece and its copy fit there together (16 MiB encode + decode: ~5% faster than 1 MiB).
_CHUNK = 1 << 19
# Up to here `isfinite`'s bool mask (a quarter of this for float32) is a small allocation
# that malloc serves from its heap, not fresh pages.
_SMALL = 1 << 18
