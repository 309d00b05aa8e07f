"""Encode and decode messages: a msgpack header plus out-of-line, 64-byte-aligned tensor bytes.

Body layout (integers little-endian)::

    b"SMQ\\x01" | u32 header length H | msgpack header (H bytes) | zero pad to 64 | tensor data

The header is a msgpack map `{"v": SCHEMA_VERSION, "type": <class name>, <field>: <value>...}`.
A tensor is a map `{dtype, shape, data}` whose `data` is an ext value naming `(offset, nbytes)`
in the data section, so tensor bytes never pass through msgpack (which copies them on pack and
unpack). Tensors are packed in header order, each at the next 64-byte boundary; an empty tensor
has offset 0; nothing follows the last one. Decoding checks the whole header and layout before
touching tensor bytes, then returns zero-copy views into the body.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NamedTuple, TypeVar, overload

import msgpack
import numpy as np

from broker.bodies import fresh_body
from broker.errors import DecodeError, EncodeError, UnexpectedMessageError
from broker.messages import SCHEMAS, SCHEMAS_BY_CLASS, Message, consistency_error
from broker.schema import (
    CodecLimits,
    FieldPlan,
    FieldSpec,
    HeaderReader,
    HeaderWriter,
    MessageSchema,
    Placed,
    compile_fields,
)
from broker.tensors import (
    ALIGN,
    TensorSlot,
    align,
    all_finite,
    copy_checked,
    finite_array,
    shareable,
    unpack_ext,
    view_from,
    wire_bytes,
)

__all__ = [
    "DEFAULT_LIMITS",
    "MAGIC",
    "SCHEMA_VERSION",
    "UNEXPECTED",
    "CodecLimits",
    "decode",
    "encode",
    "encode_into",
    "message_type_name",
]

MAGIC = b"SMQ\x01"
SCHEMA_VERSION = 1
_PREFIX = struct.Struct("<4sI")
_ZEROS = bytes(ALIGN)
_RESERVED = frozenset({"v", "type"})
_OFFSET = operator.attrgetter("offset")
# Reason prefix when decode meets an exception it did not anticipate: still a DecodeError for
# the caller (bad input must never crash a service), but a bug for us; the fuzz tests look for it.
UNEXPECTED = "unexpected decoder failure: "
DEFAULT_LIMITS = CodecLimits()
_PACK_BUFFER = 4096  # initial msgpack buffer; it grows for larger headers
# Bodies from this size up are written in place (see `encode`); below, joining costs less.
_IN_PLACE = 1 << 20
# Each schema's field checks, prepared once rather than re-derived from its specs per message.
_PLANS: Mapping[str, tuple[FieldPlan, ...]] = MappingProxyType(
    {name: compile_fields(schema) for name, schema in SCHEMAS.items()}
)
# Every key a header of each type has: its fields and the reserved ones.
_KEYS: Mapping[str, frozenset[str]] = MappingProxyType(
    {name: frozenset(s.name for s in schema.fields) | _RESERVED for name, schema in SCHEMAS.items()}
)
# The fields (position, spec) that decoding must turn from slots into tensor views; the rest
# pass through as they are.
_TENSOR_FIELDS: Mapping[str, tuple[tuple[int, FieldSpec], ...]] = MappingProxyType(
    {
        name: tuple((i, s) for i, s in enumerate(schema.fields) if s.tensor is not None)
        for name, schema in SCHEMAS.items()
    }
)
# A header of each type before its fields are filled in: every key in place, in field order,
# so filling it never resizes the dict.
_HEADERS: Mapping[str, dict[str, object]] = MappingProxyType(
    {
        name: {"v": SCHEMA_VERSION, "type": name} | dict.fromkeys(s.name for s in schema.fields)
        for name, schema in SCHEMAS.items()
    }
)


def message_type_name(message: Message) -> str:
    """The wire `type` of a message."""
    return _schema_of_message(message).name


def encode(message: Message, limits: CodecLimits | None = None) -> bytes:
    """Validate and encode; tensor bytes are copied exactly once, into the body (plus a
    device-to-host or contiguity copy for CUDA or strided tensors).

    A body of at least `_IN_PLACE` bytes is written in place (`bodies.fresh_body`), checking
    each piece of a tensor for NaN and ±inf right after copying it; a smaller one is joined
    from its parts after checking the tensors, which costs less per message.
    """
    plan = _plan(message, limits or DEFAULT_LIMITS)
    fresh = fresh_body(plan.size) if plan.size >= _IN_PLACE else None
    if fresh is None:
        return _joined(plan)
    body, window = fresh
    reason = _fill(window, plan)
    del window  # before `body` goes anywhere: nothing may write to it afterwards
    if reason is not None:
        raise EncodeError(reason)
    return body


def encode_into(
    message: Message, buffer: bytearray, limits: CodecLimits | None = None
) -> memoryview:
    """Validate and encode into a caller-owned buffer (grown when too small); returns the body,
    a view of `buffer` valid until the next call.

    Tensors are copied and checked piece by piece as `encode` does for big bodies, straight
    from the source tensor (a torch copy for strided or non-CPU ones). The buffer cannot grow
    while a view from an earlier call is alive.
    """
    plan = _plan(message, limits or DEFAULT_LIMITS)
    if len(buffer) < plan.size:
        try:
            buffer.extend(bytes(plan.size - len(buffer)))
        except BufferError:
            raise EncodeError(
                "encode_into: the buffer must grow but an earlier view of it is still alive"
            ) from None
    window = np.frombuffer(buffer, np.uint8, plan.size)
    reason = _fill(window, plan)
    del window  # it pins the buffer's size
    if reason is not None:
        raise EncodeError(reason)
    return memoryview(buffer)[: plan.size]


Body = bytes | bytearray | memoryview
T1 = TypeVar("T1", bound=Message)
T2 = TypeVar("T2", bound=Message)
T3 = TypeVar("T3", bound=Message)


@overload
def decode(body: Body, limits: CodecLimits | None = None) -> Message: ...
@overload
def decode(body: Body, limits: CodecLimits | None = None, *, expect: type[T1]) -> T1: ...
@overload
def decode(
    body: Body, limits: CodecLimits | None = None, *, expect: tuple[type[T1], type[T2]]
) -> T1 | T2: ...
@overload
def decode(
    body: Body,
    limits: CodecLimits | None = None,
    *,
    expect: tuple[type[T1], type[T2], type[T3]],
) -> T1 | T2 | T3: ...
@overload
def decode(
    body: Body, limits: CodecLimits | None = None, *, expect: tuple[type[Message], ...]
) -> Message: ...
def decode(
    body: Body,
    limits: CodecLimits | None = None,
    *,
    expect: type[Any] | tuple[type[Any], ...] | None = None,
) -> Message:
    """Validate `body` and return its message: every check a consumer needs of the body, once;
    raises `DecodeError` and nothing else. With `expect`, a message of another type raises
    `UnexpectedMessageError` (before its tensors are looked at).

    Tensors are zero-copy views of `body` (read-only in spirit when `body` is bytes: clone
    before modifying in place).
    """
    wanted = (expect,) if isinstance(expect, type) else expect
    try:
        return _decode(body, limits or DEFAULT_LIMITS, wanted)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"{UNEXPECTED}{type(exc).__name__}: {exc}") from exc


# --- encoding -----------------------------------------------------------------------------------


class _Plan(NamedTuple):
    prefix: bytes  # magic, header length and header
    data_start: int
    size: int
    tensors: list[Placed]


def _schema_of_message(message: object) -> MessageSchema:
    schema = SCHEMAS_BY_CLASS.get(type(message))  # type: ignore[arg-type]
    if schema is None:
        raise EncodeError(f"{type(message).__name__} is not a SplitMQ message type")
    return schema


def _plan(message: Message, limits: CodecLimits) -> _Plan:
    schema = _schema_of_message(message)
    writer = HeaderWriter(limits, encoding=True)
    header = _HEADERS[schema.name].copy()
    max_bytes = limits.max_string_len
    for plan in _PLANS[schema.name]:
        name = plan.name
        value = getattr(message, name)
        fast = plan.fast
        header[name] = (
            value if fast is not None and fast(value, max_bytes) else plan.walk(writer, value)
        )
    reason = consistency_error(message)
    if reason is not None:
        raise EncodeError(reason)
    # packb would build a Packer with a 256 KiB buffer per call; headers are small.
    packed: bytes = msgpack.Packer(use_bin_type=True, buf_size=_PACK_BUFFER).pack(header)
    if len(packed) > limits.max_header_bytes:
        raise EncodeError(
            f"{schema.name}: header of {len(packed)} bytes exceeds {limits.max_header_bytes}"
        )
    prefix = _PREFIX.pack(MAGIC, len(packed)) + packed
    data_start = align(len(prefix))
    size = data_start + writer.cursor if writer.cursor else len(prefix)
    if size > limits.max_body_bytes:
        raise EncodeError(
            f"{schema.name}: body of {size} bytes exceeds the limit of {limits.max_body_bytes}"
        )
    return _Plan(prefix, data_start, size, writer.tensors)


def _joined(plan: _Plan) -> bytes:
    """The body of `plan` by `bytes.join`, its tensors checked first."""
    parts: list[bytes | memoryview] = [plan.prefix]
    position = len(plan.prefix)
    for placed in plan.tensors:
        host, check = placed.host, placed.check
        if check is not None and not (
            all_finite(placed.tensor) if host is None else finite_array(host, check)
        ):
            raise EncodeError(_non_finite(placed))
        start = plan.data_start + placed.offset
        parts.append(_ZEROS[: start - position])
        # The finite check's numpy view of the tensor is its wire bytes when contiguous.
        data = None if host is None else host.data
        parts.append(data if data is not None and data.c_contiguous else wire_bytes(placed.tensor))
        position = start + placed.nbytes
    return b"".join(parts)


def _fill(window: np.ndarray[Any, np.dtype[np.uint8]], plan: _Plan) -> str | None:
    """Write the body of `plan` into `window` (exactly `plan.size` bytes), checking tensors
    as they are copied; the reason of the first check that fails, else None.

    Returns rather than raises: a traceback would keep this frame, and with it `window` (and
    the buffer it pins), alive.
    """
    prefix = plan.prefix
    window[: len(prefix)] = np.frombuffer(prefix, np.uint8)
    position = len(prefix)
    for placed in plan.tensors:
        start = plan.data_start + placed.offset
        window[position:start] = 0  # padding: no stale bytes of a reused buffer leak out
        end = start + placed.nbytes
        if not copy_checked(window[start:end], placed.tensor, placed.host, placed.check):
            return _non_finite(placed)
        position = end
    return None


def _non_finite(placed: Placed) -> str:
    return f"{placed.path}: holds NaN or infinite values"


# --- decoding -----------------------------------------------------------------------------------


def _decode(body: Body, limits: CodecLimits, expect: tuple[type[Any], ...] | None) -> Message:
    view = _byte_view(body)
    header, header_end = _read_header(view, limits)
    schema = _schema_of_header(header)
    if expect is not None and schema.cls not in expect:
        raise UnexpectedMessageError(schema.name, " or ".join(t.__name__ for t in expect))
    reader = HeaderReader(limits, encoding=False)
    values = reader.fields(schema, _PLANS[schema.name], header, _KEYS[schema.name])
    data_start = _check_layout(reader.slots, header_end, len(view))
    data = shareable(view) if reader.slots else view
    for index, spec in _TENSOR_FIELDS[schema.name]:
        values[index] = _materialise(spec, values[index], data, data_start)
    message: Message = schema.cls(*values)  # every field, in declaration order
    reason = consistency_error(message)
    if reason is not None:
        raise DecodeError(reason)
    return message


def _byte_view(body: object) -> memoryview:
    try:
        view = memoryview(body)  # type: ignore[arg-type]
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"body is not a contiguous byte buffer: {exc}") from None


def _read_header(view: memoryview, limits: CodecLimits) -> tuple[dict[object, object], int]:
    size = len(view)
    if size > limits.max_body_bytes:
        raise DecodeError(f"body of {size} bytes exceeds the limit of {limits.max_body_bytes}")
    if size < _PREFIX.size:
        raise DecodeError(f"truncated prefix: body has {size} bytes, needs {_PREFIX.size}")
    magic, length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise DecodeError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if length > limits.max_header_bytes:
        raise DecodeError(
            f"header of {length} bytes exceeds the limit of {limits.max_header_bytes}"
        )
    end = _PREFIX.size + length
    if end > size:
        raise DecodeError(
            f"truncated header: prefix announces {length} bytes, {size - _PREFIX.size} follow"
        )
    try:
        header = msgpack.unpackb(
            view[_PREFIX.size : end],
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_string_len,
            max_bin_len=0,  # no field is a bin: tensor bytes live outside the header
            max_array_len=max(limits.max_rank, 64),
            max_map_len=max(limits.max_dict_entries, 64),
            max_ext_len=64,
            ext_hook=unpack_ext,
        )
    except Exception as exc:  # msgpack raises a zoo of types for garbage; all mean the same
        raise DecodeError(f"header is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if not isinstance(header, dict):
        raise DecodeError(f"header must be a map, got {type(header).__name__}")
    return header, end


def _schema_of_header(header: dict[object, object]) -> MessageSchema:
    version = header.get("v")
    if type(version) is not int:
        raise DecodeError(f"header needs an integer schema version 'v', got {version!r}")
    if version != SCHEMA_VERSION:
        raise DecodeError(f"unknown schema version {version} (this codec reads {SCHEMA_VERSION})")
    name = header.get("type")
    schema = SCHEMAS.get(name) if isinstance(name, str) else None
    if schema is None:
        raise DecodeError(f"unknown message type {name!r}")
    return schema


def _check_layout(slots: list[TensorSlot], header_end: int, body_size: int) -> int:
    """Check tensor data is packed in order at 64-byte boundaries inside the body with nothing
    after it; return where the data section starts."""
    data_start = align(header_end)
    cursor = 0
    previous: TensorSlot | None = None
    placed = [s for s in slots if s.nbytes]
    if len(placed) > 1:
        placed.sort(key=_OFFSET)
    for slot in placed:
        offset, end = slot.offset, slot.offset + slot.nbytes
        if offset % ALIGN:
            raise DecodeError(f"{_span(slot)} is not {ALIGN}-byte aligned")
        if previous is not None and offset < cursor:
            raise DecodeError(f"{_span(slot)} overlaps {previous.path}")
        if offset != align(cursor):
            raise DecodeError(f"{_span(slot)} leaves a gap: expected offset {align(cursor)}")
        if data_start + end > body_size:
            available = max(0, body_size - data_start)
            raise DecodeError(f"{_span(slot)} lies outside the {available}-byte data section")
        cursor = end
        previous = slot
    for slot in slots:
        if not slot.nbytes and slot.offset:
            raise DecodeError(f"{slot.path}: empty tensor has offset {slot.offset}, expected 0")
    expected = data_start + cursor if cursor else header_end
    if body_size != expected:
        raise DecodeError(f"body has {body_size} bytes, its layout accounts for {expected}")
    return data_start


def _span(slot: TensorSlot) -> str:
    return f"{slot.path}: data [{slot.offset}, {slot.offset + slot.nbytes})"


def _materialise(spec: FieldSpec, raw: object, body: memoryview, data_start: int) -> object:
    rule = spec.tensor
    if rule is None or raw is None:
        return raw
    finite = rule.finite
    if isinstance(raw, TensorSlot):
        return view_from(body, data_start, raw, finite=finite)
    assert isinstance(raw, dict)  # a tensor map, as `_Walker.value` built it
    return {key: view_from(body, data_start, slot, finite=finite) for key, slot in raw.items()}
