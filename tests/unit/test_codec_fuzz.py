"""Property tests: whatever the bytes, `decode` returns a valid message or raises DecodeError.

Inputs are random bytes, random headers behind a valid prefix, and valid encodings mutated by
bit flips, truncation, splices, insertions, deletions, header field swaps and tampered tensor
references. A decoded message counts as valid when `encode` (which validates everything)
accepts it again. A per-example deadline turns a hang or a huge allocation into a failure.
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Any

import msgpack
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.codec import MAGIC, UNEXPECTED, decode, encode
from broker.errors import DecodeError
from broker.messages import (
    MESSAGE_TYPES,
    Error,
    GradientReply,
    Heartbeat,
    InferReply,
    Join,
    Message,
    RoundDropped,
    SmashedBatch,
    WeightsUpdate,
)
from broker.tensors import ALIGN, WIRE_DTYPES

FUZZ = settings(
    max_examples=400,
    deadline=timedelta(seconds=2),  # generous for a loaded CI box; a hang takes far longer
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# Structured header mutations cost more per example (recursive strategies, re-packing).
FUZZ_HEADERS = settings(FUZZ, max_examples=300)


def _ids(**extra: Any) -> dict[str, Any]:
    return {"job": "j", "client": "c", "message_id": "m1", "version": 2} | extra


def _pool() -> list[Message]:
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    return [
        Join(**_ids(samples=10, info={"k": "v"})),
        Heartbeat(**_ids()),
        Error(**_ids(code="x", reason="y", ref_message_id="z")),
        RoundDropped(**_ids(round=1, reason="non_finite", ref_message_id="a", detail="d")),
        SmashedBatch(
            **_ids(
                seq=1,
                shard=0,
                round=0,
                step=3,
                activations=randn(3, 2, 2),
                labels=torch.tensor([1, 0, 2]),
            )
        ),
        GradientReply(
            **_ids(seq=1, status="ok", loss=0.5, correct=1, samples=3, grad=randn(3, 4).half())
        ),
        InferReply(**_ids(seq=4, logits=randn(2, 3).bfloat16())),
        WeightsUpdate(
            **_ids(
                round=1,
                samples=5,
                client_weights={"w": randn(2, 3), "n": torch.tensor(3), "e": torch.zeros(0)},
                aux_weights={"h": randn(4)},
                masks={"w": randn(2, 3) > 0},
                metrics={"acc": 0.5},
            )
        ),
    ]


VALID = tuple(encode(message) for message in _pool())


def check(body: bytes) -> None:
    try:
        message = decode(body)
    except DecodeError as exc:
        assert not exc.reason.startswith(UNEXPECTED), exc.reason
        return
    assert type(message) in MESSAGE_TYPES
    # Whatever decodes must be a message encode accepts, and survive another round trip.
    assert type(decode(encode(message))) is type(message)


def split(body: bytes) -> tuple[dict[str, Any], bytes]:
    (length,) = struct.unpack_from("<I", body, 4)
    data_start = -(-(8 + length) // ALIGN) * ALIGN
    return msgpack.unpackb(body[8 : 8 + length], raw=False), body[data_start:]


def tensor_maps_in(header: dict[str, Any]) -> list[dict[str, Any]]:
    found = []
    for value in header.values():
        if isinstance(value, dict) and "dtype" in value:
            found.append(value)
        elif isinstance(value, dict):
            found.extend(v for v in value.values() if isinstance(v, dict))
    return found


def frame(header: object, data: bytes) -> bytes:
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    head = MAGIC + struct.pack("<I", len(packed)) + packed
    return head + bytes(-len(head) % ALIGN) + data if data else head


valid = st.sampled_from(VALID)
ints = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry
u64 = st.one_of(st.integers(0, 1024), st.integers(0, 2**64 - 1))
refs = st.builds(lambda o, n: msgpack.ExtType(1, struct.pack("<QQ", o, n)), u64, u64)
exts = st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20))
dims = st.one_of(st.integers(-2, 70), ints, st.booleans(), st.floats())
tensor_maps = st.fixed_dictionaries(
    {
        "dtype": st.one_of(st.sampled_from([*WIRE_DTYPES, "complex64", ""]), ints),
        "shape": st.one_of(st.lists(dims, max_size=10), ints),
        "data": st.one_of(refs, exts, st.none()),
    }
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(),
    st.text(max_size=20),
    st.binary(max_size=8),
    exts,
    refs,
)
values = st.recursive(
    st.one_of(scalars, tensor_maps),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(body: bytes) -> None:
    check(body)


@FUZZ
@given(st.binary(max_size=512), st.binary(max_size=512))
def test_random_header_behind_a_valid_prefix(header: bytes, tail: bytes) -> None:
    check(MAGIC + struct.pack("<I", len(header)) + header + tail)


@FUZZ
@given(valid, st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 7)), min_size=1, max_size=8))
def test_bit_flips(body: bytes, flips: list[tuple[int, int]]) -> None:
    mutated = bytearray(body)
    for position, bit in flips:
        mutated[position % len(mutated)] ^= 1 << bit
    check(bytes(mutated))


@FUZZ
@given(valid, valid, st.integers(0, 2**16), st.integers(0, 2**16), st.integers(0, 2**16))
def test_truncation_and_splices(a: bytes, b: bytes, cut: int, i: int, j: int) -> None:
    check(a[: cut % (len(a) + 1)])
    check(a[: i % (len(a) + 1)] + b[j % (len(b) + 1) :])


@FUZZ
@given(valid, st.integers(0, 2**16), st.binary(min_size=1, max_size=80), st.integers(1, 80))
def test_insertions_and_deletions(body: bytes, at: int, extra: bytes, length: int) -> None:
    position = at % (len(body) + 1)
    check(body[:position] + extra + body[position:])
    check(body[:position] + body[position + length :])


@FUZZ_HEADERS
@given(valid, st.data())
def test_header_field_swaps_and_replacements(body: bytes, data: st.DataObject) -> None:
    header, tail = split(body)
    keys = sorted(header)
    a, b = data.draw(st.sampled_from(keys)), data.draw(st.sampled_from(keys))
    header[a], header[b] = header[b], header[a]
    check(frame(header, tail))
    header[data.draw(st.sampled_from(keys))] = data.draw(values)
    if data.draw(st.booleans()):
        header[data.draw(st.text(max_size=6))] = data.draw(values)
    check(frame(header, tail))


@FUZZ_HEADERS
@given(st.sampled_from(VALID[4:]), st.data())
def test_tampered_tensor_maps(body: bytes, data: st.DataObject) -> None:
    header, tail = split(body)
    target = data.draw(st.sampled_from(tensor_maps_in(header)))
    field = data.draw(st.sampled_from(["dtype", "shape", "data"]))
    target[field] = data.draw(tensor_maps)[field]
    extra = data.draw(st.binary(max_size=128))
    check(frame(header, tail + extra if data.draw(st.booleans()) else tail))
