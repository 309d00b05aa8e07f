"""Check message field values against their schema, in both directions.

`HeaderWriter` turns a message's fields into header values, laying its tensors out in the data
section; it is lenient about Python types (an int may fill a float field, an IntEnum an int,
any Mapping a map). `HeaderReader` checks decoded header values, accepting exact types only,
and describes tensors as `TensorSlot`s for the codec to lay over the body. bool never passes as
an int either way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NoReturn

import numpy as np
import torch

from broker.errors import DecodeError, EncodeError
from broker.schema import (
    INT64_MAX,
    INT64_MIN,
    MAP_VALUE_KINDS,
    CodecLimits,
    FieldSpec,
    Kind,
    MessageSchema,
    TensorRule,
    map_reason,
    scalar_reason,
    tensor_reason,
)
from broker.tensors import (
    FloatBits,
    TensorSlot,
    align,
    host_array,
    parse_tensor_header,
    tensor_header,
    wire_dtype,
)

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
