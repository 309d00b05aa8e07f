"""A message's wire schema, read off its dataclass annotations, and the checks it implies.

A field's base type picks its `Kind` (how it travels); `Annotated` markers add constraints:

    seq: Annotated[int, NonNegative()]
    activations: Annotated[torch.Tensor, TensorRule(FLOAT_DTYPES, finite=True, min_rank=1)]

The check functions return a precise reason string (or None) so that the encoder can raise
`EncodeError` and the decoder `DecodeError` from the same rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import Enum
from types import MappingProxyType
from typing import Annotated, Any, get_args, get_origin

import torch

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
