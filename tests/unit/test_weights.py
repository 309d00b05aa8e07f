"""Weights <-> safetensors bytes: exact round trips and validation both ways."""

from __future__ import annotations

import hashlib

import pytest
import torch
from safetensors.torch import save as raw_safetensors_save

from broker.errors import DecodeError, EncodeError
from broker.weights import (
    ALLOWED_DTYPES,
    decode_verified,
    decode_weights,
    encode_weights,
    sha256_hex,
)


def _assert_same(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(actual) == set(expected)
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype, name
        assert actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name], tensor), name


def test_round_trip_is_exact_for_every_allowed_dtype() -> None:
    g = torch.Generator().manual_seed(0)
    weights = {}
    for dtype in sorted(ALLOWED_DTYPES, key=str):
        if dtype.is_floating_point:
            weights[str(dtype)] = torch.randn(3, 5, generator=g).to(dtype)
        elif dtype == torch.bool:
            weights[str(dtype)] = torch.rand(7, generator=g) > 0.5
        else:
            weights[str(dtype)] = torch.randint(-100, 100, (2, 2, 2), generator=g).to(dtype)
    weights["scalar"] = torch.tensor(3.25)
    weights["empty"] = torch.empty(0, 4)
    _assert_same(decode_weights(encode_weights(weights)), weights)


def test_extreme_finite_values_survive() -> None:
    weights = {
        "f32": torch.tensor([torch.finfo(torch.float32).max, -0.0, 1e-45]),
        "bf16": torch.tensor([torch.finfo(torch.bfloat16).max], dtype=torch.bfloat16),
        "i64": torch.tensor([torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max]),
    }
    _assert_same(decode_weights(encode_weights(weights)), weights)


def test_views_and_tied_weights_are_encoded_by_value() -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    weights = {
        "transposed": base.t(),  # non-contiguous
        "slice": base[1:3],  # view into a larger storage
        "tied_a": base,
        "tied_b": base,  # same tensor twice, as tied embeddings are
    }
    decoded = decode_weights(encode_weights(weights))
    _assert_same(decoded, {k: v.contiguous() for k, v in weights.items()})
    decoded["tied_a"][0, 0] = -1.0
    assert decoded["tied_b"][0, 0] == 0.0, "decoded tensors must not alias each other"


def test_encoding_does_not_touch_or_alias_the_input() -> None:
    w = torch.ones(3, requires_grad=True)
    decoded = decode_weights(encode_weights({"w": w}))
    decoded["w"].add_(1.0)
    assert torch.equal(w.detach(), torch.ones(3))
    assert not decoded["w"].requires_grad


def test_encoding_is_deterministic() -> None:
    weights = {"b": torch.arange(6.0), "a": torch.zeros(2, 2, dtype=torch.int64)}
    assert encode_weights(weights) == encode_weights(dict(reversed(list(weights.items()))))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_weights_are_rejected_on_encode(bad: float, dtype: torch.dtype) -> None:
    weights = {"ok": torch.ones(2), "layer.weight": torch.tensor([1.0, bad, 2.0], dtype=dtype)}
    with pytest.raises(EncodeError, match=r"'layer.weight' has non-finite"):
        encode_weights(weights)


def test_non_finite_weights_are_rejected_on_decode() -> None:
    # Bytes from a writer that skipped validation (another tool, or a bug) must not load.
    data = raw_safetensors_save({"w": torch.tensor([0.0, float("nan")])})
    with pytest.raises(DecodeError, match="non-finite"):
        decode_weights(data)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.float8_e4m3fn])
def test_unsupported_dtypes_are_rejected_both_ways(dtype: torch.dtype) -> None:
    tensor = torch.zeros(4).to(dtype)
    with pytest.raises(EncodeError, match="unsupported dtype"):
        encode_weights({"w": tensor})
    with pytest.raises(DecodeError, match="unsupported dtype"):
        decode_weights(raw_safetensors_save({"w": tensor}))


@pytest.mark.parametrize(
    "weights",
    [
        {"w": [1.0, 2.0]},
        {"": torch.ones(1)},
        {3: torch.ones(1)},
        {"sparse": torch.eye(3).to_sparse()},
    ],
    ids=["not-a-tensor", "empty-name", "non-str-name", "sparse"],
)
def test_malformed_mappings_are_rejected(weights: dict[object, object]) -> None:
    with pytest.raises(EncodeError):
        encode_weights(weights)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"garbage that is not safetensors",
        b"\xff" * 64,
        (10).to_bytes(8, "little") + b'{"w": 1}xx',  # header is JSON but not a tensor table
    ],
    ids=["empty", "text", "huge-header-length", "bad-header"],
)
def test_garbage_bytes_raise_decode_error(data: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_weights(data)


def test_truncated_blob_raises_decode_error() -> None:
    data = encode_weights({"w": torch.randn(64)})
    with pytest.raises(DecodeError):
        decode_weights(data[:-8])


def test_non_bytes_input_raises_decode_error() -> None:
    with pytest.raises(DecodeError, match="bytes"):
        decode_weights("not bytes")  # type: ignore[arg-type]


def test_decode_verified_checks_size_and_hash() -> None:
    data = encode_weights({"w": torch.arange(10.0)})
    digest = hashlib.sha256(data).hexdigest()
    assert sha256_hex(data) == digest
    _assert_same(decode_verified(data, digest, len(data), "blob"), {"w": torch.arange(10.0)})
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(DecodeError, match="sha256 mismatch"):
        decode_verified(flipped, digest, len(data), "blob")
    with pytest.raises(DecodeError, match="size"):
        decode_verified(data[:-4], digest, len(data), "blob")
