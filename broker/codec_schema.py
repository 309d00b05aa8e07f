"""The wire schema of each message type and the checks of a field's value, both directions.

A message dataclass of `broker.messages` is read once into a `Schema`: each field's wire kind
(scalar, tensor, map of either) and its checks, from its annotation and markers. Encoding and
decoding (`broker.codec`) check a whole message's fields in one call, `Walker.fields`: a scalar
of exactly its type is tested inline (the fast path); anything else takes the long way, where a
`Writer` (encode) or `Reader` (decode) walks the value, converts what it may and raises the
precise reason. Tensors are laid out as they are met: the writer places each in the data section
and writes its header map, the reader checks the map and collects the slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Annotated, Any, ClassVar, NamedTuple, get_args, get_origin

import msgpack
import numpy as np
import torch

from broker.errors import DecodeError, EncodeError
from broker.messages import CROSS_CHECKED, MESSAGE_TYPES, Marker, OneOf, TensorRule
from broker.tensors import (
    ALIGN,
    BY_TORCH,
    HEADER_KEYS,
    REF,
    TENSOR_EXT_CODE,
    WIRE_DTYPES,
    FloatBits,
    TensorSlot,
    ref_problem,
    shape_reason,
)

SCHEMA_VERSION = 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


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
    # A scalar field's type: a value of exactly it that passes the fast path's inline test of
    # `checks[0]` (the four fields below) travels as it is. Anything else takes the long way,
    # which converts what it may or raises the precise reason: the fast path changes no
    # outcome, only its cost.
    exact: type | None
    low: int = INT64_MIN  # an int's least value
    non_empty: bool = False  # a str's
    choices: frozenset[str] | None = None  # a str's
    finite: bool = False  # a float's


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
    cross_checked: bool  # whether `consistency_error` has anything to say about it


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
        cross_checked=cls in CROSS_CHECKED,
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
    choices = [m.choices for m in markers if isinstance(m, OneOf)] if scalar else []
    return Field(
        name,
        path,
        kind,
        checks,
        rules[0] if rules else None,
        kind.types[0] if scalar else None,
        low=0 if scalar and Marker.NON_NEGATIVE in markers else INT64_MIN,
        non_empty=scalar and Marker.NON_EMPTY in markers,
        choices=next(iter(choices), None),
        finite=scalar and Marker.FINITE in markers,
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
SCHEMAS: Mapping[type[Any], Schema] = MappingProxyType(
    {cls: build_schema(cls) for cls in MESSAGE_TYPES}
)
BY_NAME: Mapping[str, Schema] = MappingProxyType({s.name: s for s in SCHEMAS.values()})


@dataclass
class Walker:
    """The encoder's walk of a field's value the long way; `Reader` narrows it to the decoder's."""

    limits: CodecLimits
    tensor_count: int = 0
    error: ClassVar[type[Exception]] = EncodeError

    def fields(self, schema: Schema, values: Iterable[object]) -> list[object]:
        """Each field's value as it travels, in `schema`'s order. A scalar of exactly its type
        that plainly passes its checks, as tested inline here, travels as it is (the fast path:
        no call per field); anything else is checked the long way, a tensor by `tensor`."""
        max_bytes = self.limits.max_string_len
        travelling: list[object] = []
        for spec, value in zip(schema.fields, values, strict=True):
            if type(value) is not spec.exact:
                rule = spec.tensor
                if rule is None or spec.kind.is_map or value is None:
                    value = self.value(spec, value)  # a map, a missing tensor, or a conversion
                else:
                    value = self.tensor(value, rule, spec.path)
            elif type(value) is int:
                if not spec.low <= value <= INT64_MAX:
                    value = self.value(spec, value)
            elif type(value) is str:
                # An ASCII string's UTF-8 size is its length (and it always encodes).
                if (
                    not (value.isascii() and len(value) <= max_bytes)
                    or (spec.non_empty and not value)
                    or (spec.choices is not None and value not in spec.choices)
                ):
                    value = self.value(spec, value)
            elif type(value) is float and spec.finite and not math.isfinite(value):
                value = self.value(spec, value)
            travelling.append(value)
        return travelling

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

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        raise NotImplementedError  # each direction handles tensors its own way


def rule_reason(rule: TensorRule, dtype: torch.dtype, shape: tuple[int, ...], path: str) -> str:
    """Why `rule` refuses a tensor of `dtype` and `shape` (its caller found that it does)."""
    if dtype not in rule.dtypes:
        allowed = sorted(_dtype_name(d) for d in rule.dtypes)
        return f"{path}: dtype {_dtype_name(dtype)} is not allowed here (allowed: {allowed})"
    if rule.rank is not None and len(shape) != rule.rank:
        return f"{path}: shape {list(shape)} must have rank {rule.rank}"
    if len(shape) < rule.min_rank:
        return f"{path}: shape {list(shape)} must have rank >= {rule.min_rank}"
    raise AssertionError(f"{path}: {dtype} {list(shape)} fits its rule")  # callers saw a misfit


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
class Writer(Walker):
    """Also lays out tensors: `tensors` lists every non-empty one, each at the next `ALIGN`
    boundary; `cursor` is where the data ends."""

    cursor: int = 0
    tensors: list[Placed] = field(default_factory=list)

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        """The tensor's header map (see `tensors.HEADER_KEYS`), its bytes placed after the
        others'."""
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
        # The rule and the count, as `Reader.tensor` checks them: inline, it runs per tensor.
        rank = len(shape)
        if (
            dtype.torch_dtype not in rule.dtypes
            or (rule.rank is not None and rank != rule.rank)
            or rank < rule.min_rank
        ):
            raise EncodeError(rule_reason(rule, dtype.torch_dtype, shape, path))
        self.tensor_count += 1
        if self.tensor_count > limits.max_tensors:
            raise EncodeError(f"{path}: more than {limits.max_tensors} tensors")
        nbytes = math.prod(shape) * dtype.itemsize
        offset = 0
        if nbytes:
            offset = -(-self.cursor // ALIGN) * ALIGN
            self.cursor = offset + nbytes
            # One numpy view of a CPU tensor serves the finite check and the copy (as
            # `tensors.host_array`: bfloat16 rides as int16, a dtype view tracks no gradient).
            host = None
            if value.is_cpu:
                carrier = value.detach() if value.requires_grad else value
                host = (
                    carrier.view(torch.int16) if dtype.view_as is torch.bfloat16 else carrier
                ).numpy()
            check = dtype.bits if rule.finite else None
            self.tensors.append(Placed(offset, nbytes, value, host, check, path))
        # ExtType.__new__ re-checks its code and data in Python, a third of this map's cost;
        # ours are valid by construction, so build the namedtuple as that __new__ finally does.
        ref = tuple.__new__(msgpack.ExtType, (TENSOR_EXT_CODE, REF.pack(offset, nbytes)))
        return {"dtype": dtype.name, "shape": list(shape), "data": ref}


@dataclass
class Reader(Walker):
    """Tensors become `TensorSlot`s (collected in `slots`); `codec.decode` checks their layout
    and only then turns them into views of the body."""

    error: ClassVar[type[Exception]] = DecodeError
    slots: list[TensorSlot] = field(default_factory=list)

    def convert(self, kind: type, value: object) -> object | None:
        return value if type(value) is kind else None

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        """A tensor's header map (unpacked with `unpack_ext`) as its checked slot."""
        if not isinstance(value, dict):
            raise DecodeError(f"{path}: expected a tensor map, got {type(value).__name__}")
        if value.keys() != HEADER_KEYS:
            found = sorted(str(k) for k in value)
            raise DecodeError(
                f"{path}: tensor map needs keys ['data', 'dtype', 'shape'], has {found}"
            )
        name = value["dtype"]
        dtype = WIRE_DTYPES.get(name) if isinstance(name, str) else None
        if dtype is None:
            raise DecodeError(
                f"{path}: dtype {name!r} is not allowed (allowed: {sorted(WIRE_DTYPES)})"
            )
        limits = self.limits
        max_rank, max_dim = limits.max_rank, limits.max_body_bytes
        shape = value["shape"]
        if type(shape) is not list or len(shape) > max_rank:
            raise DecodeError(shape_reason(shape, path, max_rank=max_rank, max_dim=max_dim))
        needed = dtype.itemsize
        for dim in shape:
            # bool is an int subclass; a shape of [True] is garbage, not [1].
            if type(dim) is not int or dim < 0 or dim > max_dim:
                raise DecodeError(shape_reason(shape, path, max_rank=max_rank, max_dim=max_dim))
            needed *= dim
        ref = value["data"]
        if type(ref) is not tuple:  # `unpack_ext` makes well-formed references tuples
            ref_problem(ref, path)
        offset, nbytes = ref
        if needed != nbytes:
            raise DecodeError(f"{path}: shape {shape} needs {needed} bytes, data has {nbytes}")
        dims, rank = tuple(shape), len(shape)
        if (  # the rule and the count, as `Writer.tensor` checks them
            dtype.torch_dtype not in rule.dtypes
            or (rule.rank is not None and rank != rule.rank)
            or rank < rule.min_rank
        ):
            raise DecodeError(rule_reason(rule, dtype.torch_dtype, dims, path))
        self.tensor_count += 1
        if self.tensor_count > limits.max_tensors:
            raise DecodeError(f"{path}: more than {limits.max_tensors} tensors")
        slot = TensorSlot(path, dtype, dims, offset, nbytes)
        self.slots.append(slot)
        return slot
