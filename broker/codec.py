"""Encode and decode messages: a msgpack header plus out-of-line, 64-byte-aligned tensor bytes.

The body layout, the schema read off `broker.messages` and the checks of both directions:
docs/architecture.md, "Messages on the wire". The schema and each field's checks are
`broker.codec_schema`'s; this module lays out and reads back whole bodies.
"""

from __future__ import annotations

import operator
import struct
from typing import Any, NamedTuple, NoReturn, TypeVar, overload

import msgpack
import numpy as np

from broker.bodies import fresh_body
from broker.codec_schema import (
    BY_NAME,
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    SCHEMAS,
    CodecLimits,
    Placed,
    Reader,
    Schema,
    Writer,
)
from broker.errors import DecodeError, EncodeError, UnexpectedMessageError
from broker.messages import Message, consistency_error
from broker.tensors import (
    ALIGN,
    TensorSlot,
    all_finite,
    copy_checked,
    finite_array,
    host_array,
    unpack_ext,
    view_from,
    writable_alias,
)

# CodecLimits: the bounds `encode` and `decode` take, with them (it lives with the schema).
__all__ = ["MAGIC", "UNEXPECTED", "CodecLimits", "decode", "encode", "encode_into"]

MAGIC = b"SMQ\x01"
_PREFIX = struct.Struct("<4sI")
_ZEROS = bytes(ALIGN)
_OFFSET = operator.attrgetter("offset")
# Reason prefix when decode meets an exception it did not anticipate: still a DecodeError for
# the caller (bad input must never crash a service), but a bug for us; the fuzz tests look for it.
UNEXPECTED = "unexpected decoder failure: "
_PACK_BUFFER = 4096  # initial msgpack buffer; it grows for larger headers
# Bodies from this size up are written in place (`bodies.fresh_body`), each piece of a tensor
# checked right after its copy; below, joining after the check costs less per message.
_IN_PLACE = 1 << 20


def encode(message: Message, limits: CodecLimits | None = None) -> bytes:
    """Validate and encode; tensor bytes are copied exactly once, into the body (plus a
    device-to-host or contiguity copy for CUDA or strided tensors). In place or joined: see
    `_IN_PLACE` and docs/benchmarks.md, codec section.
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
    """Validate and encode into a caller-owned buffer (grown when too small), as `encode` writes
    a big body in place; returns the body, a view of `buffer` valid until the next call. The
    buffer cannot grow while a view from an earlier call is alive.
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


class _Plan(NamedTuple):
    prefix: bytes  # magic, header length and header
    data_start: int
    size: int
    tensors: list[Placed]


def _plan(message: Message, limits: CodecLimits) -> _Plan:
    schema = SCHEMAS.get(type(message))
    if schema is None:
        raise EncodeError(f"{type(message).__name__} is not a SplitMQ message type")
    writer = Writer(limits)
    header = dict(schema.header)
    travelling = writer.fields(schema, [getattr(message, spec.name) for spec in schema.fields])
    for spec, value in zip(schema.fields, travelling, strict=True):
        header[spec.name] = value
    if schema.cross_checked:
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
    data_start = -(-len(prefix) // ALIGN) * ALIGN
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
        # The finite check's numpy view of the tensor is its wire bytes when contiguous; a strided
        # or non-CPU tensor takes one contiguous host copy.
        data = None if host is None else host.data
        if data is None or not data.c_contiguous:
            data = host_array(placed.tensor.detach().cpu().contiguous()).data
        parts.append(data)
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


Body = bytes | bytearray | memoryview
T = TypeVar("T", bound=Message)


@overload
def decode(body: Body, limits: CodecLimits | None = None) -> Message: ...
@overload
def decode(body: Body, limits: CodecLimits | None = None, *, expect: type[T]) -> T: ...
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
        limits = limits or DEFAULT_LIMITS
        view, header, header_end, schema = _read_header(body, limits)
        if wanted is not None and schema.cls not in wanted:
            raise UnexpectedMessageError(schema.name, " or ".join(t.__name__ for t in wanted))
        if header.keys() != schema.header.keys():  # one C-level set comparison
            _key_problem(schema, header)
        reader = Reader(limits)
        values = reader.fields(schema, [header[spec.name] for spec in schema.fields])
        if reader.slots:
            data_start = _check_layout(reader.slots, header_end, len(view))
            _materialise(schema, values, view, data_start)
        elif len(view) != header_end:
            raise DecodeError(f"body has {len(view)} bytes, its layout accounts for {header_end}")
        message: Message = schema.cls(*values)  # every field, in declaration order
        if schema.cross_checked:
            reason = consistency_error(message)
            if reason is not None:
                raise DecodeError(reason)
        return message
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"{UNEXPECTED}{type(exc).__name__}: {exc}") from exc


def _read_header(
    body: object, limits: CodecLimits
) -> tuple[memoryview, dict[object, object], int, Schema]:
    """`body` as bytes, its header, where the header ends and the schema the header names."""
    try:
        view = memoryview(body)  # type: ignore[arg-type]
        view = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (TypeError, ValueError) as exc:
        raise DecodeError(f"body is not a contiguous byte buffer: {exc}") from None
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
    version = header.get("v")
    if type(version) is not int:
        raise DecodeError(f"header needs an integer schema version 'v', got {version!r}")
    if version != SCHEMA_VERSION:
        raise DecodeError(f"unknown schema version {version} (this codec reads {SCHEMA_VERSION})")
    name = header.get("type")
    schema = BY_NAME.get(name) if isinstance(name, str) else None
    if schema is None:
        raise DecodeError(f"unknown message type {name!r}")
    return view, header, end, schema


def _key_problem(schema: Schema, header: dict[object, object]) -> NoReturn:
    # `v` and `type` are there (`_read_header` read them): a field is missing or unknown.
    for spec in schema.fields:
        if spec.name not in header:
            raise DecodeError(f"{schema.name}: missing field {spec.name!r}")
    unknown = sorted(repr(k) for k in header if k not in schema.header)
    raise DecodeError(f"{schema.name}: unknown field {unknown[0]}")


def _check_layout(slots: list[TensorSlot], header_end: int, body_size: int) -> int:
    """Check tensor data is packed in order at 64-byte boundaries inside the body with nothing
    after it; return where the data section starts."""
    data_start = -(-header_end // ALIGN) * ALIGN
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
        packed = -(-cursor // ALIGN) * ALIGN  # where it starts when nothing lies in between
        if offset != packed:
            raise DecodeError(f"{_span(slot)} leaves a gap: expected offset {packed}")
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


def _materialise(schema: Schema, values: list[object], body: memoryview, data_start: int) -> None:
    """Turn the tensor slots among `values` into views of `body`, checked (`view_from`)."""
    # A read-only body (a received `bytes`) goes through a writable alias: see `view_from`.
    data = writable_alias(body).data if body.readonly else body
    for index in schema.tensor_fields:
        raw, spec = values[index], schema.fields[index]
        finite = spec.tensor is not None and spec.tensor.finite
        if isinstance(raw, TensorSlot):
            values[index] = view_from(data, data_start, raw, finite=finite)
        elif raw is not None:
            assert isinstance(raw, dict)  # a tensor map, as `Walker.value` built it
            values[index] = {
                k: view_from(data, data_start, v, finite=finite) for k, v in raw.items()
            }
