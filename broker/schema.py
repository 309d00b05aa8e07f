"""A message's wire schema, read off its dataclass annotations, and the checks it implies.

A field's base type picks its `Kind` (how it travels); `Annotated` markers add constraints:

    seq: Annotated[int, NonNegative()]
    activations: Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]

The check functions return a precise reason string (or None) so that the encoder can raise
`EncodeError` and the decoder `DecodeError` from the same rules.

Both directions apply them field by field: `HeaderWriter` turns a message's fields into header
values, laying its tensors out in the data section; it is lenient about Python types (an int
may fill a float field, an IntEnum an int, any Mapping a map). `HeaderReader` checks decoded
header values, accepting exact types only, and describes tensors as `TensorSlot`s for the codec
to lay over the body. bool never passes as an int either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import Enum
from types import MappingProxyType
from typing import Annotated, Any, NamedTuple, NoReturn, get_args, get_origin

import numpy as np
import torch

from broker.errors import DecodeError, EncodeError
from broker.tensors import (
    FloatBits,
    TensorSlot,
    align,
    host_array,
    parse_tensor_header,
    tensor_header,
    wire_dtype,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class NonEmpty:
    """A string that must not be empty."""


@dataclass(frozen=True, slots=True)
class NonNegative:
    """An integer that must be >= 0."""


@dataclass(frozen=True, slots=True)
class Finite:
    """A float that must be neither NaN nor infinite."""


@dataclass(frozen=True, slots=True)
class OneOf:
    """A string restricted to `choices`."""

    choices: frozenset[str]


@dataclass(frozen=True, slots=True)
class TensorRule:
    """What a tensor field (or every value of a tensor-map field) may hold.

    `finite` applies to floating-point dtypes only, so a weights map may also carry integer
    buffers such as BatchNorm's `num_batches_tracked`.
    """

    dtypes: frozenset[torch.dtype]
    finite: bool = False
    rank: int | None = None
    min_rank: int = 0


@dataclass(frozen=True, slots=True)
class CodecLimits:
    """Bounds that keep a hostile body cheap. The codec's encoder obeys them too, so what it
    produces decodes under the same limits."""

    max_body_bytes: int = 256 * 2**20
    max_header_bytes: int = 4 * 2**20
    max_tensors: int = 4096
    max_string_len: int = 64 * 2**10  # bytes of UTF-8, keys included
    max_dict_entries: int = 4096
    max_rank: int = 8


class Kind(Enum):
    """How a field travels; the value names it in error messages."""

    STR = "str"
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"
    TENSOR = "tensor"
    OPTIONAL_TENSOR = "tensor or nil"
    TENSOR_MAP = "map of tensors"
    STR_MAP = "map of str"
    FLOAT_MAP = "map of float"
    CONFIG_MAP = "map of str/int/float/bool"


TENSOR_KINDS = frozenset({Kind.TENSOR, Kind.OPTIONAL_TENSOR, Kind.TENSOR_MAP})
# The scalar kinds a map's values may take, tried in order (bool before int: bool is an int).
MAP_VALUE_KINDS: Mapping[Kind, tuple[Kind, ...]] = MappingProxyType(
    {
        Kind.STR_MAP: (Kind.STR,),
        Kind.FLOAT_MAP: (Kind.FLOAT,),
        Kind.CONFIG_MAP: (Kind.BOOL, Kind.INT, Kind.FLOAT, Kind.STR),
    }
)

_KINDS: Mapping[Any, Kind] = MappingProxyType(
    {
        str: Kind.STR,
        int: Kind.INT,
        float: Kind.FLOAT,
        bool: Kind.BOOL,
        torch.Tensor: Kind.TENSOR,
        torch.Tensor | None: Kind.OPTIONAL_TENSOR,
        Mapping[str, torch.Tensor]: Kind.TENSOR_MAP,
        Mapping[str, str]: Kind.STR_MAP,
        Mapping[str, float]: Kind.FLOAT_MAP,
        Mapping[str, str | int | float | bool]: Kind.CONFIG_MAP,
    }
)


@dataclass(frozen=True, slots=True)
class FieldSpec:
    name: str
    kind: Kind
    non_empty: bool = False
    non_negative: bool = False
    finite: bool = False
    choices: frozenset[str] | None = None
    tensor: TensorRule | None = None


@dataclass(frozen=True, slots=True)
class MessageSchema:
    name: str
    cls: type[Any]
    fields: tuple[FieldSpec, ...]


def build_schema(cls: type[Any]) -> MessageSchema:
    """The schema of a message dataclass. Its module must not use `from __future__ import
    annotations`: the field types have to be real objects, not strings."""
    specs = tuple(_field_spec(f"{cls.__name__}.{f.name}", f.name, f.type) for f in fields(cls))
    return MessageSchema(cls.__name__, cls, specs)


def _field_spec(path: str, name: str, annotation: Any) -> FieldSpec:
    markers: list[Any] = []
    if get_origin(annotation) is Annotated:
        annotation, *markers = get_args(annotation)
    kind = None if isinstance(annotation, str) else _KINDS.get(annotation)
    if kind is None:
        raise TypeError(f"{path}: no wire kind for annotation {annotation!r}")
    rules = [m for m in markers if isinstance(m, TensorRule)]
    if (kind in TENSOR_KINDS) != (len(rules) == 1):
        raise TypeError(f"{path}: a tensor field needs exactly one TensorRule, others none")
    choices = [m.choices for m in markers if isinstance(m, OneOf)]
    return FieldSpec(
        name=name,
        kind=kind,
        non_empty=any(isinstance(m, NonEmpty) for m in markers),
        non_negative=any(isinstance(m, NonNegative) for m in markers),
        finite=any(isinstance(m, Finite) for m in markers),
        choices=choices[0] if choices else None,
        tensor=rules[0] if rules else None,
    )


# --- checks -------------------------------------------------------------------------------------


def scalar_reason(
    kind: Kind, spec: FieldSpec | None, value: object, path: str, max_string_bytes: int
) -> str | None:
    """Why `value` (already of `kind`'s Python type) breaks `spec`'s markers, or None."""
    if isinstance(value, str):
        return _string_reason(spec, value, path, max_string_bytes)
    if kind is Kind.INT and isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            return f"{path}: {value} is outside the int64 range"
        if spec is not None and spec.non_negative and value < 0:
            return f"{path}: {value} must be >= 0"
    if kind is Kind.FLOAT and isinstance(value, float):
        if spec is not None and spec.finite and not math.isfinite(value):
            return f"{path}: {value} is not finite"
    return None


def _string_reason(spec: FieldSpec | None, value: str, path: str, max_bytes: int) -> str | None:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return f"{path}: string is not encodable as UTF-8"
    if size > max_bytes:
        return f"{path}: string of {size} bytes exceeds the limit of {max_bytes}"
    if spec is not None and spec.non_empty and not value:
        return f"{path}: must not be empty"
    if spec is not None and spec.choices is not None and value not in spec.choices:
        return f"{path}: {value!r} is not one of {sorted(spec.choices)}"
    return None


def map_reason(keys: list[object], path: str, max_entries: int, max_key_bytes: int) -> str | None:
    """Why a map with these keys may not travel, or None."""
    if len(keys) > max_entries:
        return f"{path}: {len(keys)} entries exceed the limit of {max_entries}"
    for key in keys:
        if not isinstance(key, str):
            return f"{path}: key {key!r} is not a string"
        reason = _string_reason(None, key, f"{path} key", max_key_bytes)
        if reason is not None:
            return reason
    return None


def tensor_reason(
    rule: TensorRule, dtype: torch.dtype, shape: tuple[int, ...], path: str
) -> str | None:
    """Why a tensor of this dtype and shape breaks `rule`, or None."""
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


# --- applying the checks, field by field ------------------------------------------------------

# A precompiled check: true when a value is exactly its field's plain Python type and passes
# every marker, so it travels as is (the second argument is the string byte limit). When false,
# the generic walk decides: it converts what it may (an IntEnum, an int for a float) or raises
# with the precise reason, so the fast path never changes an outcome, only its cost.
FastCheck = Callable[[object, int], bool]


@dataclass(frozen=True, slots=True)
class FieldPlan:
    """One field of a schema, prepared once: its spec, error path and fast check (if scalar)."""

    name: str
    spec: FieldSpec
    path: str
    fast: FastCheck | None
    tensor: TensorRule | None  # set for a plain (required, single) tensor field

    def walk(self, walker: _Walker, value: object) -> object:
        """`value` as it travels, checked the long way (when `fast` is None or said no)."""
        if self.tensor is not None:
            return walker.tensor(value, self.tensor, self.path)
        return walker.value(self.spec, value, self.path)


def compile_fields(schema: MessageSchema) -> tuple[FieldPlan, ...]:
    """The per-field plans of `schema`, in field order; build once per schema, not per call."""
    return tuple(
        FieldPlan(
            spec.name,
            spec,
            f"{schema.name}.{spec.name}",
            _fast_check(spec),
            spec.tensor if spec.kind is Kind.TENSOR else None,
        )
        for spec in schema.fields
    )


def _fast_check(spec: FieldSpec) -> FastCheck | None:
    kind = spec.kind
    if kind is Kind.STR:
        non_empty, choices = spec.non_empty, spec.choices

        def check_str(value: object, max_bytes: int) -> bool:
            # An ASCII string's UTF-8 size is its length (and it always encodes).
            return (
                type(value) is str
                and value.isascii()
                and len(value) <= max_bytes
                and (not non_empty or len(value) > 0)
                and (choices is None or value in choices)
            )

        return check_str
    if kind is Kind.INT:
        low = 0 if spec.non_negative else INT64_MIN

        def check_int(value: object, max_bytes: int) -> bool:
            return type(value) is int and low <= value <= INT64_MAX

        return check_int
    if kind is Kind.FLOAT:
        finite = spec.finite

        def check_float(value: object, max_bytes: int) -> bool:
            return type(value) is float and (not finite or math.isfinite(value))

        return check_float
    if kind is Kind.BOOL:
        return lambda value, max_bytes: type(value) is bool
    return None


@dataclass
class _Walker:
    """What both directions share: scalar, map and limit checks."""

    limits: CodecLimits
    encoding: bool
    tensor_count: int = 0

    def fail(self, reason: str) -> Exception:
        return EncodeError(reason) if self.encoding else DecodeError(reason)

    def value(self, spec: FieldSpec, value: object, path: str) -> object:
        if spec.tensor is not None and not (spec.kind is Kind.OPTIONAL_TENSOR and value is None):
            if spec.kind is not Kind.TENSOR_MAP:
                return self.tensor(value, spec.tensor, path)
            rule = spec.tensor
            return {k: self.tensor(v, rule, f"{path}[{k!r}]") for k, v in self.map(value, path)}
        if spec.kind is Kind.OPTIONAL_TENSOR:
            return None
        if spec.kind in MAP_VALUE_KINDS:
            kinds = MAP_VALUE_KINDS[spec.kind]
            items = self.map(value, path)
            return {k: self.scalar(kinds, None, v, f"{path}[{k!r}]") for k, v in items}
        return self.scalar((spec.kind,), spec, value, path)

    def map(self, value: object, path: str) -> list[tuple[str, object]]:
        if not isinstance(value, Mapping if self.encoding else dict):
            raise self.fail(f"{path}: expected a map, got {type(value).__name__}")
        items = list(value.items())
        limits = self.limits
        reason = map_reason(
            [k for k, _ in items], path, limits.max_dict_entries, limits.max_string_len
        )
        if reason is not None:
            raise self.fail(reason)
        return items

    def scalar(
        self, kinds: tuple[Kind, ...], spec: FieldSpec | None, value: object, path: str
    ) -> object:
        """`value` as the first of `kinds` it fits, checked against `spec`'s markers."""
        for kind in kinds:
            converted = self.convert(kind, value)
            if converted is not None:
                reason = scalar_reason(kind, spec, converted, path, self.limits.max_string_len)
                if reason is not None:
                    raise self.fail(reason)
                return converted
        expected = " or ".join(k.value for k in kinds)
        raise self.fail(f"{path}: expected {expected}, got {type(value).__name__}")

    def convert(self, kind: Kind, value: object) -> object | None:
        if not self.encoding:
            return value if type(value) is _EXACT_TYPES[kind] else None
        if isinstance(value, bool) != (kind is Kind.BOOL):
            return None
        if kind is Kind.FLOAT and isinstance(value, int | float):
            return float(value)
        wanted = _EXACT_TYPES[kind]
        # Normalise subclasses (IntEnum, str enums) to the plain type msgpack writes.
        return wanted(value) if isinstance(value, wanted) else None

    def count_tensor(self, path: str) -> None:
        self.tensor_count += 1
        if self.tensor_count > self.limits.max_tensors:
            raise self.fail(f"{path}: more than {self.limits.max_tensors} tensors")

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        raise NotImplementedError  # each direction handles tensors its own way


_EXACT_TYPES: Mapping[Kind, type] = {
    Kind.BOOL: bool,
    Kind.INT: int,
    Kind.FLOAT: float,
    Kind.STR: str,
}


class Placed(NamedTuple):
    """A non-empty tensor laid out in the data section, not yet checked for NaN and ±inf: the
    codec does that as it copies the tensor into the body."""

    offset: int  # from the start of the data section
    nbytes: int
    tensor: torch.Tensor
    host: np.ndarray[Any, Any] | None  # `host_array(tensor)` for a CPU tensor, else None
    check: FloatBits | None  # the float format to check when its rule wants finite values
    path: str


@dataclass
class HeaderWriter(_Walker):
    """Also lays out tensors: `tensors` lists every non-empty one, each at the next `ALIGN`
    boundary; `cursor` is where the data ends."""

    cursor: int = 0
    tensors: list[Placed] = field(default_factory=list)

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        if not isinstance(value, torch.Tensor):
            raise EncodeError(f"{path}: expected a tensor, got {type(value).__name__}")
        dtype = wire_dtype(value.dtype)
        if dtype is None or value.layout != torch.strided:
            raise EncodeError(f"{path}: a {value.layout} {value.dtype} tensor cannot travel")
        shape = tuple(value.shape)
        reason = _rank_reason(shape, path, self.limits) or tensor_reason(
            rule, dtype.torch_dtype, shape, path
        )
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


@dataclass
class HeaderReader(_Walker):
    """Tensors become `TensorSlot`s (collected in `slots`); the codec checks their layout and
    only then turns them into views of the body."""

    slots: list[TensorSlot] = field(default_factory=list)

    def fields(
        self,
        schema: MessageSchema,
        plans: tuple[FieldPlan, ...],
        header: dict[object, object],
        keys: frozenset[str],
    ) -> list[object]:
        """Raw field values, in field order; `plans` is `compile_fields(schema)`; `keys` names
        every key `header` must have: the fields and the reserved keys that are not fields
        (`v`, `type`)."""
        if header.keys() != keys:  # one C-level set comparison
            _key_problem(schema, plans, header, keys)
        max_bytes = self.limits.max_string_len
        values: list[object] = []
        for plan in plans:
            value = header[plan.name]
            fast = plan.fast
            values.append(
                value if fast is not None and fast(value, max_bytes) else plan.walk(self, value)
            )
        return values

    def tensor(self, value: object, rule: TensorRule, path: str) -> object:
        limits = self.limits
        slot = parse_tensor_header(
            value, path, max_rank=limits.max_rank, max_dim=limits.max_body_bytes
        )
        reason = tensor_reason(rule, slot.dtype.torch_dtype, slot.shape, path)
        if reason is not None:
            raise DecodeError(reason)
        self.tensor_count += 1
        if self.tensor_count > limits.max_tensors:
            raise DecodeError(f"{path}: more than {limits.max_tensors} tensors")
        self.slots.append(slot)
        return slot


def _key_problem(
    schema: MessageSchema,
    plans: tuple[FieldPlan, ...],
    header: dict[object, object],
    keys: frozenset[str],
) -> NoReturn:
    for plan in plans:
        if plan.name not in header:
            raise DecodeError(f"{schema.name}: missing field {plan.name!r}")
    unknown = sorted(repr(k) for k in header if k not in keys)
    if unknown:
        raise DecodeError(f"{schema.name}: unknown field {unknown[0]}")
    missing = sorted(keys - header.keys())
    raise DecodeError(f"{schema.name}: missing header key {missing[0]!r}")


def _rank_reason(shape: tuple[int, ...], path: str, limits: CodecLimits) -> str | None:
    if len(shape) > limits.max_rank:
        return f"{path}: rank {len(shape)} exceeds the limit of {limits.max_rank}"
    if shape and max(shape) > limits.max_body_bytes:
        return f"{path}: shape {list(shape)} has a dimension beyond {limits.max_body_bytes}"
    return None
