"""The finite check on its own and through the codec, on both sides of the wire.

`all_finite` and the decoder test floats on their bits with two integer max reductions (see
`broker.tensors.FloatBits`) and scan big contiguous arrays in chunks, so these tests put bad
values at the edges of the bit patterns (signed NaNs, NaN payloads, the largest finite values)
and at the edges of chunks, for every wire float dtype, contiguous or strided.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import numpy as np
import pytest
import torch

from broker.codec import decode, encode, encode_into
from broker.errors import DecodeError, EncodeError
from broker.messages import GradientReply, SmashedBatch, WeightsUpdate
from broker.tensors import _CHUNK, _SMALL, WIRE_DTYPES, all_finite, finite_array, host_array

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16}
# Bit patterns by width: (largest finite, +inf, quiet NaN, NaN with only the lowest payload bit)
PATTERNS = {
    2: {"float16": (0x7BFF, 0x7C00, 0x7E00, 0x7C01), "bfloat16": (0x7F7F, 0x7F80, 0x7FC0, 0x7F81)},
    4: {"float32": (0x7F7F_FFFF, 0x7F80_0000, 0x7FC0_0000, 0x7F80_0001)},
    8: {
        "float64": (
            0x7FEF_FFFF_FFFF_FFFF,
            0x7FF0_0000_0000_0000,
            0x7FF8_0000_0000_0000,
            0x7FF0_0000_0000_0001,
        )
    },
}
INT_OF_WIDTH = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def from_bits(pattern: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-element tensor of `dtype` holding exactly the bits `pattern` (sign bit included)."""
    width = dtype.itemsize
    signed = pattern - (1 << 8 * width) if pattern >> (8 * width - 1) else pattern
    return torch.tensor([signed], dtype=INT_OF_WIDTH[width]).view(dtype)


def patterns(dtype: torch.dtype) -> tuple[int, int, int, int]:
    return PATTERNS[dtype.itemsize][str(dtype).removeprefix("torch.")]


def common() -> dict[str, Any]:
    return {"job": "j", "client": "c", "message_id": "m", "version": 1}


def smashed(activations: torch.Tensor) -> SmashedBatch:
    rows = activations.shape[0]
    return SmashedBatch(
        **common(),
        seq=1,
        shard=0,
        round=0,
        step=0,
        activations=activations,
        labels=torch.zeros(rows, dtype=torch.int64),
    )


# --- the bits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS)
def test_every_bit_pattern_class_is_judged_right(dtype: torch.dtype) -> None:
    largest, infinity, quiet_nan, low_nan = patterns(dtype)
    sign = 1 << (8 * dtype.itemsize - 1)
    finite = [0, sign, 1, sign | 1, largest, sign | largest]  # ±0, ±smallest subnormal, ±max
    bad = [infinity, quiet_nan, low_nan, sign | infinity, sign | quiet_nan, sign | low_nan]
    bad.append((1 << 8 * dtype.itemsize) - 1)  # all bits set: a negative NaN
    for pattern in finite:
        assert all_finite(from_bits(pattern, dtype)), hex(pattern)
    for pattern in bad:
        assert not all_finite(from_bits(pattern, dtype)), hex(pattern)
        assert not all_finite(torch.cat([from_bits(largest, dtype), from_bits(pattern, dtype)]))


@pytest.mark.parametrize("dtype", FLOATS)
def test_bits_agree_with_torch_isfinite_on_random_patterns(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    width = INT_OF_WIDTH[dtype.itemsize]
    info = torch.iinfo(width)
    raw = torch.randint(info.min, info.max, (4096,), generator=generator, dtype=width)
    values = raw.view(dtype)
    expected = torch.isfinite(values.to(torch.float64))
    for index in range(0, 4096, 64):
        part = values[index : index + 64]
        assert all_finite(part) == bool(expected[index : index + 64].all()), index


def test_the_wire_float_dtypes_all_have_bits_and_nothing_else_does() -> None:
    floats = {name for name, wire in WIRE_DTYPES.items() if wire.bits is not None}
    assert floats == {"float64", "float32", "float16", "bfloat16"}


# --- chunks and strides --------------------------------------------------------------------------


def chunk_edges(size: int, itemsize: int) -> list[int]:
    step = _CHUNK // itemsize
    edges = {0, size // 2, size - 1}
    for start in range(step, size, step):
        edges |= {start - 1, start}
    return sorted(e for e in edges if 0 <= e < size)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("nbytes", [400, _SMALL + 64, 3 * _CHUNK + 40])
def test_a_bad_value_is_found_in_any_chunk(dtype: torch.dtype, nbytes: int) -> None:
    # Each scan strategy: small (isfinite for float32/64), one piece, pieces (the last short).
    size = nbytes // dtype.itemsize
    tensor = torch.zeros(size, dtype=dtype)
    assert all_finite(tensor)
    for position in chunk_edges(size, dtype.itemsize):
        for bad in (math.nan, math.inf, -math.inf):
            tensor[position] = bad
            assert not all_finite(tensor), (position, bad)
            tensor[position] = 0


@pytest.mark.parametrize("dtype", FLOATS)
def test_strided_and_grad_tracking_tensors_are_checked_in_place(dtype: torch.dtype) -> None:
    base = torch.zeros(64, 2 * _CHUNK // dtype.itemsize // 64 + 3, dtype=dtype)
    views = [base.t(), base[:, ::3], base[::2], base.unsqueeze(0).expand(2, -1, -1)]
    for view in views:
        assert all_finite(view)
    base[-1, -1] = math.nan  # in every view but the every-other-row one
    assert [all_finite(v) for v in views] == [False, base.shape[1] % 3 != 1, True, False]
    tracked = torch.zeros(5, dtype=dtype, requires_grad=True) * 1
    assert all_finite(tracked)
    assert not all_finite(tracked / 0)


def test_finite_array_reads_any_carrier_of_the_same_width() -> None:
    # The decoder hands it the body's bytes as the wire carrier (int16 for bfloat16).
    bits = WIRE_DTYPES["bfloat16"].bits
    assert bits is not None
    values = torch.tensor([1.0, -2.0, math.inf], dtype=torch.bfloat16)
    carrier = host_array(values)
    assert carrier.dtype == np.int16
    assert not finite_array(carrier, bits)
    assert finite_array(carrier[:2], bits)


def test_empty_and_integer_tensors_are_finite() -> None:
    assert all_finite(torch.zeros(0, 3))
    assert all_finite(torch.tensor([-1, 2**62]))
    assert all_finite(torch.tensor(math.nan).reshape(1)[:0])


# --- through the codec ---------------------------------------------------------------------------


def big_activations(dtype: torch.dtype) -> torch.Tensor:
    columns = 256
    rows = 2 * _CHUNK // (columns * dtype.itemsize) + 1  # spans three chunks
    return torch.randn(rows, columns, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_encoders_refuse_a_bad_value_in_any_chunk(dtype: torch.dtype, where: str) -> None:
    activations = big_activations(dtype)
    index = {"first": 0, "middle": activations.numel() // 2, "last": -1}[where]
    activations.view(-1)[index] = math.nan
    for source in (activations, activations.t().contiguous().t()):  # contiguous and strided
        message = smashed(source)
        match = "SmashedBatch.activations: holds NaN or infinite values"
        with pytest.raises(EncodeError, match=match):
            encode(message)
        with pytest.raises(EncodeError, match=match):
            encode_into(message, bytearray())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_decoder_refuses_a_bad_value_in_any_chunk(
    dtype: torch.dtype, where: str, bad: float
) -> None:
    activations = big_activations(dtype)
    body = bytearray(encode(smashed(activations)))
    labels_bytes = activations.shape[0] * 8
    data_start = len(body) - labels_bytes - (-activations.nbytes % 64) - activations.nbytes
    index = {"first": 0, "middle": activations.numel() // 2, "last": activations.numel() - 1}
    position = data_start + index[where] * dtype.itemsize
    value = torch.tensor([bad], dtype=dtype).view(INT_OF_WIDTH[dtype.itemsize]).item()
    struct.pack_into("<i" if dtype.itemsize == 4 else "<h", body, position, value)
    with pytest.raises(DecodeError) as info:
        decode(bytes(body))
    assert info.value.reason == "SmashedBatch.activations: holds NaN or infinite values"


def test_decoder_checks_every_finite_field_and_every_tensor_of_a_map() -> None:
    weights = {"a": torch.ones(3), "b": torch.ones(2, 2, dtype=torch.float16), "n": torch.tensor(2)}
    update = WeightsUpdate(**common(), round=0, samples=1, client_weights=weights, aux_weights={})
    body = bytearray(encode(update))
    # Data: "a" at 0, "b" at 64, int64 "n" at 128 (8 bytes, the end): make b's last value -inf.
    struct.pack_into("<H", body, len(body) - 8 - 64 + 6, 0xFC00)
    with pytest.raises(DecodeError, match=r"client_weights\['b'\]: holds NaN or infinite values"):
        decode(bytes(body))
    reply = GradientReply(
        **common(),
        seq=1,
        status="ok",
        loss=0.0,
        correct=0,
        samples=1,
        grad=torch.tensor([[1.0, math.inf]]),
    )
    with pytest.raises(EncodeError, match=r"GradientReply\.grad: holds NaN or infinite values"):
        encode(reply)


def test_decoded_values_survive_the_check_bit_exact() -> None:
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        largest = patterns(dtype)[0]
        sign = 1 << (8 * dtype.itemsize - 1)
        edge = torch.cat([from_bits(p, dtype) for p in (largest, sign | largest, 1, sign)])
        activations = edge.repeat(8, 1)
        decoded = decode(encode(smashed(activations)))
        assert isinstance(decoded, SmashedBatch)
        bits = INT_OF_WIDTH[dtype.itemsize]
        assert torch.equal(decoded.activations.view(bits), activations.view(bits))
