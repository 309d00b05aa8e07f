"""Encode and decode messages: a msgpack header plus out-of-line, 64-byte-aligned tensor bytes.

The body layout, the schema read off `broker.messages` and the checks of both directions:
docs/architecture.md, "Messages on the wire".
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import (
    Annotated,
    Any,
    ClassVar,
    NamedTuple,
    NoReturn,
    TypeVar,
    get_args,
    get_origin,
    overload,
)

import msgpack
import numpy as np
import torch

from broker.bodies import fresh_body
from broker.errors import DecodeError, EncodeError, UnexpectedMessageError
from broker.messages import (
    MESSAGE_TYPES,
    Marker,
    Message,
    OneOf,
    TensorRule,
    consistency_error,
)
from broker.tensors import (
    ALIGN,
    BY_TORCH,
    FloatBits,
    TensorSlot,
    align,
    all_finite,
    copy_checked,
    finite_array,
    host_array,
    parse_tensor_header,
    shape_reason,
    shareable,
    tensor_header,
    unpack_ext,
    view_from,
)

MAGIC = b"SMQ\x01"
SCHEMA_VERSION = 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
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


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds that keep a hostile body cheap; the encoder obeys them too."""

    max_body_bytes: int = 256 * 2**20
    max_header_bytes: int = 4 * 2**20
    max_tensors: int = 4096
    max_string_len: int = 64 * 2**10  # bytes of UTF-8, keys included
    max_dict_entries: int = 4096
    max_rank: int = 8


DEFAULT_LIMITS = CodecLimits()


class Kind(NamedTuple):
    """How a field travels: a scalar of the first of `types` it fits (bool before int: bool is
    an int), a tensor when `types` is empty; with `is_map`, a map from strings to those."""

    types: tuple[type, ...] = ()
    is_map: bool = False
    optional: bool = False  # a tensor that may be None


_KINDS: Mapping[Any, Kind] = MappingProxyType(
    {
        str: Kind((str,)),
        int: Kind((int,)),
        float: Kind((float,)),
        bool: Kind((bool,)),
        torch.Tensor: Kind(),
        torch.Tensor | None: Kind(optional=True),
        Mapping[str, torch.Tensor]: Kind(is_map=True),
        Mapping[str, str]: Kind((str,), is_map=True),
        Mapping[str, float]: Kind((float,), is_map=True),
        Mapping[str, int]: Kind((int,), is_map=True),
        Mapping[str, str | int | float | bool]: Kind((bool, int, float, str), is_map=True),
    }
)

# A scalar's checks: (a value of exactly its type, its path, the string byte limit) -> why it
# may not travel, or None. Cheap when it passes: the fast path calls it for every field.
Check = Callable[[Any, str, int], str | None]


@dataclass(frozen=True, slots=True)
class Field:
    """One field of a message type, read off its annotation once."""

    name: str
    path: str  # "SmashedBatch.seq", as its reasons start
    kind: Kind
    checks: tuple[Check, ...]  # one per `kind.types`; a scalar field's include its markers
    tensor: TensorRule | None  # for a tensor field, or each value of a tensor map
    # A scalar field's type: a value of exactly it that passes `checks[0]` travels as it is.
    # Anything else takes the long way, which converts what it may or raises the precise
    # reason: the fast path changes no outcome, only its cost.
    exact: type | None


@dataclass(frozen=True, slots=True)
class Schema:
    """A message type's fields and what the codec needs of them, prepared once."""

    name: str
    cls: type[Any]
    fields: tuple[Field, ...]
    # Its header before the fields are filled in: every key it has ("v", "type", the fields),
    # in order, so filling a copy never resizes the dict.
    header: Mapping[str, object]
    tensor_fields: tuple[int, ...]  # the fields decoding turns from slots into views


def build_schema(cls: type[Any]) -> Schema:
    """The schema of a message dataclass (its annotations must be objects: see broker.messages)."""
    prepared = tuple(_field(f"{cls.__name__}.{f.name}", f.name, f.type) for f in fields(cls))
    names = [f.name for f in prepared]
    return Schema(
        name=cls.__name__,
        cls=cls,
        fields=prepared,
        header={"v": SCHEMA_VERSION, "type": cls.__name__} | dict.fromkeys(names),
        tensor_fields=tuple(i for i, f in enumerate(prepared) if f.tensor is not None),
    )


def _field(path: str, name: str, annotation: Any) -> Field:
    markers: list[Any] = []
    if get_origin(annotation) is Annotated:
        annotation, *markers = get_args(annotation)
    kind = None if isinstance(annotation, str) else _KINDS.get(annotation)
    if kind is None:
        raise TypeError(f"{path}: no wire kind for annotation {annotation!r}")
    rules = [m for m in markers if isinstance(m, TensorRule)]
    if (not kind.types) != (len(rules) == 1):
        raise TypeError(f"{path}: a tensor field needs exactly one TensorRule, others none")
    scalar = bool(kind.types) and not kind.is_map
    checks = tuple(_check(t, markers if scalar else []) for t in kind.types)
    return Field(
        name, path, kind, checks, rules[0] if rules else None, kind.types[0] if scalar else None
    )


def _check(kind: type, markers: list[Any]) -> Check:
    """The checks of a scalar of `kind`: the wire's own (UTF-8 strings, int64) and `markers`."""
    if kind is str:
        choices = [m.choices for m in markers if isinstance(m, OneOf)]
        return _str_check(Marker.NON_EMPTY in markers, next(iter(choices), None))
    if kind is int:
        return _int_check(0 if Marker.NON_NEGATIVE in markers else INT64_MIN)
    if kind is float and Marker.FINITE in markers:
        return _finite
    return _anything


def _str_check(non_empty: bool, choices: frozenset[str] | None) -> Check:
    def check(value: str, path: str, max_bytes: int) -> str | None:
        # An ASCII string's UTF-8 size is its length (and it always encodes).
        if not (value.isascii() and len(value) <= max_bytes):
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:
                return f"{path}: string is not encodable as UTF-8"
            if size > max_bytes:
                return f"{path}: string of {size} bytes exceeds the limit of {max_bytes}"
        if non_empty and not value:
            return f"{path}: must not be empty"
        if choices is not None and value not in choices:
            return f"{path}: {value!r} is not one of {sorted(choices)}"
        return None

    return check


def _int_check(low: int) -> Check:
    def check(value: int, path: str, max_bytes: int) -> str | None:
        if low <= value <= INT64_MAX:
            return None
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{path}: {value} is outside the int64 range"
        return f"{path}: {value} must be >= 0"

    return check


def _finite(value: float, path: str, max_bytes: int) -> str | None:
    return None if math.isfinite(value) else f"{path}: {value} is not finite"


def _anything(value: object, path: str, max_bytes: int) -> str | None:
    return None


_KEY_CHECK = _str_check(False, None)  # a map's keys
_SCHEMAS: Mapping[type[Any], Schema] = MappingProxyType(
    {cls: build_schema(cls) for cls in MESSAGE_TYPES}
)
_BY_NAME: Mapping[str, Schema] = MappingProxyType({s.name: s for s in _SCHEMAS.values()})


@dataclass
class _Walker:
    """The encoder's walk; `_Reader` narrows it to the decoder's."""

    limits: CodecLimits
    tensor_count: int = 0
    error: ClassVar[type[Exception]] = EncodeError

    def value(self, spec: Field, value: object) -> object:
        """`value` as it travels, checked the long way."""
        kind, rule, path = spec.kind, spec.tensor, spec.path
        if rule is not None:
            if kind.optional and value is None:
                return None
            if not kind.is_map:
                return self.tensor(value, rule, path)
            return {k: self.tensor(v, rule, f"{path}[{k!r}]") for k, v in self.items(value, path)}
        if kind.is_map:
            return {k: self.scalar(spec, v, f"{path}[{k!r}]") for k, v in self.items(value, path)}
        return self.scalar(spec, value, path)

    def items(self, value: object, path: str) -> list[tuple[str, object]]:
        if not isinstance(value, Mapping):  # a decoded header's maps are dicts
            raise self.error(f"{path}: expected a map, got {type(value).__name__}")
        items = list(value.items())
        limit = self.limits.max_dict_entries
        if len(items) > limit:
            raise self.error(f"{path}: {len(items)} entries exceed the limit of {limit}")
        for key, _ in items:
            if not isinstance(key, str):
                raise self.error(f"{path}: key {key!r} is not a string")
            reason = _KEY_CHECK(key, f"{path} key", self.limits.max_string_len)
            if reason is not None:
                raise self.error(reason)
        return items

    def scalar(self, spec: Field, value: object, path: str) -> object:
        """`value` as the first of the field's types it fits, checked."""
        for kind, check in zip(spec.kind.types, spec.checks, strict=True):
            converted = self.convert(kind, value)
            if converted is not None:
                reason = check(converted, path, self.limits.max_string_len)
                if reason is not None:
                    raise self.error(reason)
                return converted
        expected = " or ".join(kind.__name__ for kind in spec.kind.types)
        raise self.error(f"{path}: expected {expected}, got {type(value).__name__}")

    def convert(self, kind: type, value: object) -> object | None:
        """`value` as `kind` (which the encoder may convert it to), or None."""
        if isinstance(value, bool) != (kind is bool):
            return None
        if kind is float and isinstance(value, int | float):
            return float(value)
        # Normalise subclasses (IntEnum, str enums) to the plain type msgpack writes.
        return kind(value) if isinstance(value, kind) else None

    def count_tensor(self, path: str) -> None:
        self.tensor_count += 1
        if self.tensor_count > self.limits.max_tensors:
            raise self.error(f"{path}: more than {self.limits.max_tensors} tensors")

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        raise NotImplementedError  # each direction handles tensors its own way


def _rule_reason(
    rule: TensorRule, dtype: torch.dtype, shape: tuple[int, ...], path: str
) -> str | None:
    if dtype not in rule.dtypes:
        allowed = sorted(_dtype_name(d) for d in rule.dtypes)
        return f"{path}: dtype {_dtype_name(dtype)} is not allowed here (allowed: {allowed})"
    if rule.rank is not None and len(shape) != rule.rank:
        return f"{path}: shape {list(shape)} must have rank {rule.rank}"
    if len(shape) < rule.min_rank:
        return f"{path}: shape {list(shape)} must have rank >= {rule.min_rank}"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Placed(NamedTuple):
    """A non-empty tensor laid out in the data section, not yet checked for NaN and ±inf: the
    encoder does that as it copies the tensor into the body."""

    offset: int  # from the start of the data section
    nbytes: int
    tensor: torch.Tensor
    host: np.ndarray[Any, Any] | None  # `host_array(tensor)` for a CPU tensor, else None
    check: FloatBits | None  # the float format to check when its rule wants finite values
    path: str


@dataclass
class _Writer(_Walker):
    """Also lays out tensors: `tensors` lists every non-empty one, each at the next `ALIGN`
    boundary; `cursor` is where the data ends."""

    cursor: int = 0
    tensors: list[Placed] = field(default_factory=list)

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        if not isinstance(value, torch.Tensor):
            raise EncodeError(f"{path}: expected a tensor, got {type(value).__name__}")
        dtype = BY_TORCH.get(value.dtype)
        if dtype is None or value.layout != torch.strided:
            raise EncodeError(f"{path}: a {value.layout} {value.dtype} tensor cannot travel")
        shape = tuple(value.shape)
        limits = self.limits
        max_rank, max_dim = limits.max_rank, limits.max_body_bytes
        if len(shape) > max_rank or (shape and max(shape) > max_dim):
            raise EncodeError(shape_reason(list(shape), path, max_rank=max_rank, max_dim=max_dim))
        reason = _rule_reason(rule, dtype.torch_dtype, shape, path)
        if reason is not None:
            raise EncodeError(reason)
        self.count_tensor(path)
        nbytes = math.prod(shape) * dtype.itemsize
        offset = 0
        if nbytes:
            offset = align(self.cursor)
            self.cursor = offset + nbytes
            # One numpy view of a CPU tensor serves the finite check and the copy.
            host = host_array(value) if value.is_cpu else None
            check = dtype.bits if rule.finite else None
            self.tensors.append(Placed(offset, nbytes, value, host, check, path))
        return tensor_header(dtype, shape, offset, nbytes)


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
    schema = _SCHEMAS.get(type(message))
    if schema is None:
        raise EncodeError(f"{type(message).__name__} is not a SplitMQ message type")
    writer = _Writer(limits)
    header = dict(schema.header)
    max_bytes = limits.max_string_len
    for spec in schema.fields:  # as `_decode`'s loop: the fast path, else the long way
        value = getattr(message, spec.name)
        if type(value) is not spec.exact or spec.checks[0](value, spec.path, max_bytes):
            value = writer.value(spec, value)
        header[spec.name] = value
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


@dataclass
class _Reader(_Walker):
    """Tensors become `TensorSlot`s (collected in `slots`); `_decode` checks their layout and
    only then turns them into views of the body."""

    error: ClassVar[type[Exception]] = DecodeError
    slots: list[TensorSlot] = field(default_factory=list)

    def convert(self, kind: type, value: object) -> object | None:
        return value if type(value) is kind else None

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        limits = self.limits
        slot = parse_tensor_header(
            value, path, max_rank=limits.max_rank, max_dim=limits.max_body_bytes
        )
        reason = _rule_reason(rule, slot.dtype.torch_dtype, slot.shape, path)
        if reason is not None:
            raise DecodeError(reason)
        self.count_tensor(path)
        self.slots.append(slot)
        return slot


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
        return _decode(body, limits or DEFAULT_LIMITS, wanted)
    except DecodeError:
        raise
    except Exception as exc:
        raise DecodeError(f"{UNEXPECTED}{type(exc).__name__}: {exc}") from exc


def _decode(body: Body, limits: CodecLimits, expect: tuple[type[Any], ...] | None) -> Message:
    view = _byte_view(body)
    header, header_end = _read_header(view, limits)
    schema = _schema_of_header(header)
    if expect is not None and schema.cls not in expect:
        raise UnexpectedMessageError(schema.name, " or ".join(t.__name__ for t in expect))
    if header.keys() != schema.header.keys():  # one C-level set comparison
        _key_problem(schema, header)
    reader = _Reader(limits)
    max_bytes = limits.max_string_len
    values: list[object] = []
    for spec in schema.fields:
        value = header[spec.name]
        if type(value) is not spec.exact or spec.checks[0](value, spec.path, max_bytes):
            value = reader.value(spec, value)
        values.append(value)
    data_start = _check_layout(reader.slots, header_end, len(view))
    data = shareable(view) if reader.slots else view
    for index in schema.tensor_fields:
        values[index] = _materialise(schema.fields[index], values[index], data, data_start)
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


def _schema_of_header(header: dict[object, object]) -> Schema:
    version = header.get("v")
    if type(version) is not int:
        raise DecodeError(f"header needs an integer schema version 'v', got {version!r}")
    if version != SCHEMA_VERSION:
        raise DecodeError(f"unknown schema version {version} (this codec reads {SCHEMA_VERSION})")
    name = header.get("type")
    schema = _BY_NAME.get(name) if isinstance(name, str) else None
    if schema is None:
        raise DecodeError(f"unknown message type {name!r}")
    return schema


def _key_problem(schema: Schema, header: dict[object, object]) -> NoReturn:
    # `v` and `type` are there (`_schema_of_header` read them): a field is missing or unknown.
    for spec in schema.fields:
        if spec.name not in header:
            raise DecodeError(f"{schema.name}: missing field {spec.name!r}")
    unknown = sorted(repr(k) for k in header if k not in schema.header)
    raise DecodeError(f"{schema.name}: unknown field {unknown[0]}")


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


def _materialise(spec: Field, raw: object, body: memoryview, data_start: int) -> object:
    if raw is None:
        return None
    finite = spec.tensor is not None and spec.tensor.finite
    if isinstance(raw, TensorSlot):
        return view_from(body, data_start, raw, finite=finite)
    assert isinstance(raw, dict)  # a tensor map, as `_Walker.value` built it
    return {key: view_from(body, data_start, slot, finite=finite) for key, slot in raw.items()}
