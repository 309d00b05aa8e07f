"""The message codec: round trips, zero-copy decoding and every validation failure.

Malformed bodies are forged from valid ones: `split` a body into its header map and data
section, change the header, `frame` it again (re-padding the data section to 64 bytes).
"""

from __future__ import annotations

import ast
import dataclasses
import math
import re
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import msgpack
import numpy as np
import pytest
import torch

from broker.codec import (
    MAGIC,
    UNEXPECTED,
    CodecLimits,
    decode,
    encode,
    encode_into,
)
from broker.codec_schema import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    SCHEMAS,
    Reader,
    Writer,
    build_schema,
)
from broker.errors import DecodeError, EncodeError, UnexpectedMessageError
from broker.messages import (
    MESSAGE_TYPES,
    Error,
    Event,
    GradientReply,
    Heartbeat,
    HostHeartbeat,
    InferReply,
    InferRequest,
    Join,
    Leave,
    Marker,
    Message,
    RoundDropped,
    RoundEnd,
    RoundStart,
    ServerOutput,
    SmashedBatch,
    TailGradient,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)
from broker.tensors import ALIGN, all_finite

BROKER = Path(__file__).resolve().parents[2] / "broker"
CODEC_MODULES = ("codec.py", "codec_schema.py", "tensors.py", "messages.py")


# --- building messages and bodies ---------------------------------------------------------------


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(dtype)


def common(**extra: Any) -> dict[str, Any]:
    return {
        "job": "job-1",
        "client": "client-7",
        "message_id": new_message_id(),
        "version": 3,
    } | extra


def smashed(rows: int = 4, **extra: Any) -> SmashedBatch:
    fields: dict[str, Any] = {
        "seq": 11,
        "shard": 1,
        "round": 2,
        "step": 5,
        "activations": randn(rows, 3, 2, 2),
        "labels": torch.arange(rows, dtype=torch.int64) % 10,
    }
    return SmashedBatch(**common(**(fields | extra)))


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    return {
        "conv.weight": randn(4, 3, 3, 3, seed=seed),
        "conv.bias": randn(4, dtype=torch.float16, seed=seed + 1),
        "fc.weight": randn(2, 4, dtype=torch.bfloat16, seed=seed + 2),
        "bn.num_batches_tracked": torch.tensor(17, dtype=torch.int64),
        "bn.running_mean": torch.zeros(0, 4),
        "scale": torch.tensor(0.5, dtype=torch.float64),
    }


def all_messages() -> list[Message]:
    """One of each type, covering every dtype, empty and 0-d tensors, and all map kinds."""
    config = {"lr": 0.05, "epochs": 2, "gamma": 0.5, "name": "splitgp", "sync": True}
    return [
        Join(**common(samples=500, capability=2, info={"host": "edge-3", "gpu": ""})),
        Welcome(
            **common(
                shard=2,
                cut="layer1",
                round=4,
                client_weights=weights(1),
                aux_weights={"head.weight": randn(10, 8, seed=9)},
                config=config,
            )
        ),
        Leave(**common(reason="done")),
        Heartbeat(**common(role="worker")),
        HostHeartbeat(**common(members={"edge-0": 3, "edge-17": 0})),
        smashed(),
        smashed(activations=randn(4, 6, dtype=torch.bfloat16), labels=torch.arange(4).int()),
        smashed(activations=randn(3, 5, dtype=torch.float16), labels=torch.ones(3).to(torch.uint8)),
        smashed(labels=None),  # a U-shaped job's: the labels stay on the client
        ServerOutput(**common(seq=11, activations=randn(4, 50))),
        TailGradient(**common(seq=11, shard=1, round=2, grad=randn(4, 50, dtype=torch.float16))),
        GradientReply(
            **common(seq=11, status="ok", loss=2.25, correct=3, samples=4, grad=randn(4, 3, 2, 2))
        ),
        GradientReply(
            **common(seq=12, status="stale", loss=0.0, correct=0, samples=4, grad=None, reason="v")
        ),
        WeightsUpdate(
            **common(
                round=4,
                samples=500,
                client_weights=weights(2),
                aux_weights={},
                masks={
                    "conv.weight": randn(4, 3, 3, 3) > 0,
                    "fc": torch.ones(2, 4).to(torch.uint8),
                },
                metrics={"accuracy": 0.75, "loss": float("nan")},
            )
        ),
        RoundDropped(**common(round=4, reason="non_finite", ref_message_id="a1", detail="NaN")),
        RoundDropped(**common(round=0, reason="aborted")),
        WeightsAssignment(
            **common(
                round=5,
                participate=False,
                client_weights=weights(3),
                aux_weights={"a": randn(3)},
                config={},
            )
        ),
        InferRequest(**common(seq=1, activations=randn(2, 8))),
        InferReply(**common(seq=1, logits=randn(2, 10, dtype=torch.float16))),
        Error(**common(code="bad-batch", reason="labels out of range", ref_message_id="abc")),
        RoundStart(**common(client="", round=3, shard=1, participants={"c1": 500, "c2": 250})),
        RoundEnd(**common(client="", round=3, shard=1)),
        Event(**common(kind="version-published", data={"version": 4, "note": "ok"})),
    ]


def assert_same(decoded: object, original: object) -> None:
    assert type(decoded) is type(original)
    for f in dataclasses.fields(original):  # type: ignore[arg-type]
        got, want = getattr(decoded, f.name), getattr(original, f.name)
        if isinstance(want, torch.Tensor):
            assert_same_tensor(got, want)
        elif isinstance(want, dict) and any(isinstance(v, torch.Tensor) for v in want.values()):
            assert got.keys() == want.keys()
            for key in want:
                assert_same_tensor(got[key], want[key])
        elif isinstance(want, float) and math.isnan(want):
            assert math.isnan(got)
        elif isinstance(want, dict):
            assert got.keys() == want.keys(), f.name
            for key, value in want.items():
                same_nan = isinstance(value, float) and math.isnan(value) and math.isnan(got[key])
                assert same_nan or (got[key] == value and type(got[key]) is type(value)), key
        else:
            assert got == want and type(got) is type(want), f.name


def assert_same_tensor(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(got, want.detach())


def split(body: bytes) -> tuple[dict[str, Any], bytes]:
    """A body's header map and its data section (everything after the 64-byte pad)."""
    (length,) = struct.unpack_from("<I", body, 4)
    header = msgpack.unpackb(body[8 : 8 + length], raw=False)
    data_start = -(-(8 + length) // ALIGN) * ALIGN
    return header, body[data_start:]


def frame(header: object, data: bytes = b"", magic: bytes = MAGIC) -> bytes:
    packed: bytes = msgpack.packb(header, use_bin_type=True)
    head = magic + struct.pack("<I", len(packed)) + packed
    if not data:
        return head
    return head + bytes(-len(head) % ALIGN) + data


def ref(offset: int, nbytes: int) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack("<QQ", offset, nbytes))


def forged(message: Message, change: Callable[[dict[str, Any]], object]) -> bytes:
    header, data = split(encode(message))
    change(header)
    return frame(header, data)


def reason_of(body: bytes | bytearray | memoryview, limits: CodecLimits | None = None) -> str:
    with pytest.raises(DecodeError) as info:
        decode(body, limits)
    reason = info.value.reason
    assert not reason.startswith(UNEXPECTED), reason
    return reason


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("message", all_messages(), ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: Message) -> None:
    body = encode(message)
    assert body.startswith(MAGIC)
    assert_same(decode(body), message)
    assert split(body)[0]["type"] == type(message).__name__


DESIGN_TYPES = (
    Join,
    Welcome,
    Leave,
    Heartbeat,
    SmashedBatch,
    GradientReply,
    WeightsUpdate,
    WeightsAssignment,
    InferRequest,
    InferReply,
    Error,
)


def test_every_message_type_is_covered() -> None:
    # A new message type needs a sample in `all_messages`, so its schema is exercised here.
    assert set(DESIGN_TYPES) <= set(MESSAGE_TYPES)
    assert {type(m) for m in all_messages()} == set(MESSAGE_TYPES)


def test_header_is_a_msgpack_map_with_schema_version_and_type() -> None:
    header, data = split(encode(smashed(rows=2)))
    assert header["v"] == SCHEMA_VERSION
    assert header["type"] == "SmashedBatch"
    assert header["activations"]["dtype"] == "float32"
    assert header["activations"]["shape"] == [2, 3, 2, 2]
    assert header["activations"]["data"] == ref(0, 2 * 12 * 4)
    # Labels follow at the next 64-byte boundary, and nothing comes after them.
    assert header["labels"]["data"] == ref(128, 2 * 8)
    assert len(data) == 128 + 16


def test_decode_accepts_bytes_bytearray_and_memoryview() -> None:
    message = smashed()
    body = encode(message)
    for form in (body, bytearray(body), memoryview(body), memoryview(bytearray(body))):
        assert_same(decode(form), message)


def test_non_contiguous_and_grad_tracking_tensors_are_encoded_by_value() -> None:
    base = randn(3, 4, 2, 2).requires_grad_()
    activations = base.transpose(0, 1)  # [4, 3, 2, 2], not contiguous
    message = smashed(activations=activations)
    decoded = decode(encode(message))
    assert isinstance(decoded, SmashedBatch)
    assert decoded.activations.is_contiguous()
    assert torch.equal(decoded.activations, activations.detach())


def test_ints_fill_float_fields_and_int_subclasses_normalise() -> None:
    reply = GradientReply(
        **common(seq=1, status="ok", loss=2, correct=1, samples=1, grad=None)  # int loss
    )
    decoded = decode(encode(reply))
    assert isinstance(decoded, GradientReply)
    assert decoded.loss == 2.0 and type(decoded.loss) is float


def test_encode_into_matches_encode_and_reuses_the_buffer() -> None:
    buffer = bytearray()
    large, small = smashed(rows=64), smashed(rows=2)
    view = encode_into(large, buffer)
    assert bytes(view) == encode(large)
    capacity = len(buffer)
    view.release()
    # A smaller message reuses the buffer; stale bytes of the larger one must not leak.
    view = encode_into(small, buffer)
    assert len(buffer) == capacity
    assert bytes(view) == encode(small)
    assert_same(decode(view), small)


def test_encode_into_copies_strided_tensors_directly() -> None:
    activations = randn(2, 4, 3).transpose(0, 1)
    message = smashed(activations=activations, labels=torch.zeros(4, dtype=torch.int64))
    view = encode_into(message, bytearray())
    assert bytes(view) == encode(message)


def test_encode_into_refuses_to_grow_a_buffer_with_a_live_view() -> None:
    buffer = bytearray()
    view = encode_into(smashed(rows=1), buffer)
    with pytest.raises(EncodeError, match="still alive"):
        encode_into(smashed(rows=64), buffer)
    view.release()
    encode_into(smashed(rows=64), buffer).release()


# --- zero copy ----------------------------------------------------------------------------------


def test_decoded_tensors_are_views_into_the_body() -> None:
    body = encode(smashed(rows=64))
    decoded = decode(body)
    assert isinstance(decoded, SmashedBatch)
    base = np.frombuffer(body, dtype=np.uint8).ctypes.data
    header, data = split(body)
    data_start = len(body) - len(data)
    for tensor, field in ((decoded.activations, "activations"), (decoded.labels, "labels")):
        offset, _ = struct.unpack("<QQ", header[field]["data"].data)
        assert tensor.data_ptr() == base + data_start + offset
        assert base <= tensor.data_ptr() < base + len(body)


def test_decoded_tensors_share_memory_with_a_mutable_body() -> None:
    buffer = bytearray(encode(smashed(rows=2)))
    decoded = decode(buffer)
    assert isinstance(decoded, SmashedBatch)
    _, data = split(bytes(buffer))
    struct.pack_into("<f", buffer, len(buffer) - len(data), 42.0)  # first activation
    assert decoded.activations.flatten()[0].item() == 42.0


def test_bfloat16_travels_bit_exact_without_a_numpy_dtype() -> None:
    tensor = torch.tensor([1.0, -2.5, 3.0e38, 1.0e-38, 0.0], dtype=torch.bfloat16)
    decoded = decode(encode(InferReply(**common(seq=0, logits=tensor.reshape(1, 5)))))
    assert isinstance(decoded, InferReply)
    assert decoded.logits.dtype == torch.bfloat16
    assert torch.equal(decoded.logits.view(torch.int16), tensor.reshape(1, 5).view(torch.int16))


# --- the finite check ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_finds_any_nan_or_infinity_wherever_it_is(dtype: torch.dtype) -> None:
    # aminmax propagates NaN and sees infinities as extremes; vectorised kernels process
    # elements in blocks and tails, so try every position of small sizes and a few big ones.
    for size in [*range(1, 70), 1000, 4097, 70001]:
        positions = range(size) if size < 70 else (0, size // 3, size - 1)
        assert all_finite(torch.zeros(size, dtype=dtype))
        for position in positions:
            for bad in (math.nan, math.inf, -math.inf):
                tensor = torch.zeros(size, dtype=dtype)
                tensor[position] = bad
                assert not all_finite(tensor), (size, position, bad)


def test_all_finite_ignores_integer_and_empty_tensors() -> None:
    assert all_finite(torch.zeros(0))
    assert all_finite(torch.arange(10))
    assert all_finite(torch.tensor([float("inf")]).reshape(1, 1)[:, :0])


@pytest.mark.parametrize(
    ("build", "path"),
    [
        (lambda bad: smashed(activations=bad), "SmashedBatch.activations"),
        (
            lambda bad: GradientReply(
                **common(seq=1, status="ok", loss=1.0, correct=0, samples=4, grad=bad)
            ),
            "GradientReply.grad",
        ),
        (
            lambda bad: WeightsUpdate(
                **common(round=1, samples=4, client_weights={"w": bad}, aux_weights={})
            ),
            "WeightsUpdate.client_weights['w']",
        ),
        (lambda bad: InferReply(**common(seq=0, logits=bad)), "InferReply.logits"),
    ],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_values_are_refused_both_ways(
    build: Callable[[torch.Tensor], Message], path: str, value: float
) -> None:
    finite = randn(4, 3, 2, 2)
    bad = finite.clone()
    bad[3, 2, 1, 1] = value
    with pytest.raises(EncodeError, match=re.escape(f"{path}: holds NaN or infinite values")):
        encode(build(bad))
    # The same bad value patched into a valid body: the tensor is the first in the data section.
    body = bytearray(encode(build(finite)))
    _, data = split(bytes(body))
    struct.pack_into("<f", body, len(body) - len(data) + finite.nbytes - 4, value)
    assert reason_of(bytes(body)) == f"{path}: holds NaN or infinite values"


def test_non_finite_loss_is_refused_but_metrics_may_be_nan() -> None:
    reply = GradientReply(
        **common(seq=1, status="ok", loss=math.nan, correct=0, samples=1, grad=None)
    )
    with pytest.raises(EncodeError, match=r"GradientReply\.loss: nan is not finite"):
        encode(reply)
    valid = dataclasses.replace(reply, loss=1.0)
    assert reason_of(forged(valid, lambda h: h.update(loss=math.inf))) == (
        "GradientReply.loss: inf is not finite"
    )


# --- framing failures ---------------------------------------------------------------------------


def test_truncated_prefix() -> None:
    assert reason_of(b"SMQ") == "truncated prefix: body has 3 bytes, needs 8"
    assert reason_of(b"") == "truncated prefix: body has 0 bytes, needs 8"


def test_bad_magic() -> None:
    body = encode(Leave(**common()))
    assert reason_of(b"JSON" + body[4:]) == "bad magic b'JSON', expected b'SMQ\\x01'"


def test_truncated_header() -> None:
    body = encode(Leave(**common()))
    assert reason_of(body[:20]).startswith("truncated header: prefix announces")


def test_header_is_not_msgpack() -> None:
    body = MAGIC + struct.pack("<I", 3) + b"\xc1\xc1\xc1"  # 0xc1 is never used by msgpack
    assert reason_of(body).startswith("header is not valid msgpack:")


def test_header_with_trailing_msgpack_is_refused() -> None:
    packed = msgpack.packb({"v": 1}) + msgpack.packb(1)
    assert reason_of(MAGIC + struct.pack("<I", len(packed)) + packed).startswith(
        "header is not valid msgpack: ExtraData"
    )


def test_header_must_be_a_map() -> None:
    assert reason_of(frame([1, 2])) == "header must be a map, got list"


def test_header_may_not_carry_bin_values() -> None:
    assert "header is not valid msgpack" in reason_of(frame({"v": 1, "x": b"payload"}))


def test_unknown_schema_version() -> None:
    message = Leave(**common())
    assert reason_of(forged(message, lambda h: h.update(v=2))) == (
        "unknown schema version 2 (this codec reads 1)"
    )
    assert reason_of(forged(message, lambda h: h.update(v=True))) == (
        "header needs an integer schema version 'v', got True"
    )
    assert reason_of(forged(message, lambda h: h.pop("v"))) == (
        "header needs an integer schema version 'v', got None"
    )


def test_unknown_type() -> None:
    assert reason_of(forged(Leave(**common()), lambda h: h.update(type="Pickle"))) == (
        "unknown message type 'Pickle'"
    )


def test_missing_and_unknown_fields() -> None:
    message = Join(**common(samples=3))
    assert reason_of(forged(message, lambda h: h.pop("samples"))) == (
        "Join: missing field 'samples'"
    )
    assert reason_of(forged(message, lambda h: h.update(admin=True))) == (
        "Join: unknown field 'admin'"
    )


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("version", True, "Join.version: expected int, got bool"),
        ("version", "3", "Join.version: expected int, got str"),
        ("version", 1.0, "Join.version: expected int, got float"),
        ("version", -1, "Join.version: -1 must be >= 0"),
        ("version", 2**64 - 1, f"Join.version: {2**64 - 1} is outside the int64 range"),
        ("job", "", "Join.job: must not be empty"),
        ("job", 5, "Join.job: expected str, got int"),
        ("info", [], "Join.info: expected a map, got list"),
        ("info", {"a": 1}, "Join.info['a']: expected str, got int"),
    ],
)
def test_wrong_field_values(field: str, value: object, reason: str) -> None:
    assert (
        reason_of(forged(Join(**common(samples=1)), lambda h: h.update({field: value}))) == reason
    )


def test_a_round_dropped_reason_is_one_of_the_known_kinds() -> None:
    # The aggregator counts drops by reason and quotes the counts: no free text there.
    message = RoundDropped(**common(round=1, reason="non_finite"))
    assert reason_of(forged(message, lambda h: h.update(reason="oops"))) == (
        "RoundDropped.reason: 'oops' is not one of ['aborted', 'non_finite']"
    )
    with pytest.raises(EncodeError, match="is not one of"):
        encode(RoundDropped(**common(round=1, reason="")))


def test_wrong_scalar_types_in_other_kinds() -> None:
    reply = GradientReply(**common(seq=1, status="ok", loss=1.0, correct=0, samples=1, grad=None))
    assert reason_of(forged(reply, lambda h: h.update(loss=1))) == (
        "GradientReply.loss: expected float, got int"
    )
    assert reason_of(forged(reply, lambda h: h.update(status="great"))) == (
        "GradientReply.status: 'great' is not one of ['gone', 'ok', 'rejected', 'stale']"
    )
    assignment = next(m for m in all_messages() if isinstance(m, WeightsAssignment))
    assert reason_of(forged(assignment, lambda h: h.update(participate=1))) == (
        "WeightsAssignment.participate: expected bool, got int"
    )
    assert reason_of(forged(assignment, lambda h: h.update(config={"x": None}))) == (
        "WeightsAssignment.config['x']: expected bool or int or float or str, got NoneType"
    )


def test_map_keys_must_be_strings() -> None:
    # msgpack itself (strict_map_key, no bin values) refuses them before the schema looks.
    keys: list[object] = [b"k", 1]
    for key in keys:
        header, _ = split(encode(Join(**common(samples=1))))
        header["info"] = {key: "v"}
        assert reason_of(frame(header)).startswith("header is not valid msgpack"), key


# --- tensor failures ----------------------------------------------------------------------------


def activations_header(change: Callable[[dict[str, Any]], object]) -> bytes:
    return forged(smashed(), lambda h: change(h["activations"]))


def test_shape_and_byte_count_must_agree() -> None:
    message = smashed(rows=64, activations=randn(64, 10, 12, 12))

    def shrink(header: dict[str, Any]) -> None:
        header["activations"]["data"] = ref(0, 368636)

    assert reason_of(forged(message, shrink)) == (
        "SmashedBatch.activations: shape [64, 10, 12, 12] needs 368640 bytes, data has 368636"
    )


@pytest.mark.parametrize(
    ("dtype", "shape", "reason"),
    [
        ("complex64", [4, 3, 2, 2], "dtype 'complex64' is not allowed"),
        ("float8_e4m3fn", [4, 3, 2, 2], "dtype 'float8_e4m3fn' is not allowed"),
        (7, [4, 3, 2, 2], "dtype 7 is not allowed"),
        ("int64", [4, 3, 2, 1], "dtype int64 is not allowed here"),
    ],
)
def test_dtype_whitelist(dtype: object, shape: list[int], reason: str) -> None:
    body = activations_header(lambda t: t.update(dtype=dtype, shape=shape))
    found = reason_of(body)
    assert found.startswith(f"SmashedBatch.activations: {reason}"), found


def test_labels_dtype_and_rank_are_checked() -> None:
    message = smashed()

    def float_labels(header: dict[str, Any]) -> None:
        header["labels"].update(dtype="float64")

    assert "SmashedBatch.labels: dtype float64 is not allowed here" in reason_of(
        forged(message, float_labels)
    )

    def matrix_labels(header: dict[str, Any]) -> None:
        header["labels"].update(shape=[2, 2])

    assert reason_of(forged(message, matrix_labels)) == (
        "SmashedBatch.labels: shape [2, 2] must have rank 1"
    )


@pytest.mark.parametrize(
    ("shape", "reason"),
    [
        ([4, -3, 2, 2], "dimension -3 of shape [4, -3, 2, 2] is out of [0, "),
        ([4, 10**12, 0, 2], "dimension 1000000000000 of shape"),
        ([1] * 9, "rank 9 exceeds the limit of 8"),
        ([4, True, 12], "shape [4, True, 12] holds a non-integer dimension"),
        ([4, 3.0, 4], "shape [4, 3.0, 4] holds a non-integer dimension"),
        ("4x12", "shape must be a list, got str"),
        ([], "shape [] needs 4 bytes, data has 192"),
    ],
)
def test_bad_shapes(shape: object, reason: str) -> None:
    found = reason_of(activations_header(lambda t: t.update(shape=shape)))
    assert found.startswith(f"SmashedBatch.activations: {reason}"), found


def test_tensor_rank_rules() -> None:
    reply = InferReply(**common(seq=0, logits=randn(1)))
    found = reason_of(forged(reply, lambda h: h["logits"].update(shape=[])))
    assert found == "InferReply.logits: shape [] must have rank >= 1"


def test_a_shape_claiming_a_trillion_elements_costs_nothing() -> None:
    header = {
        "v": 1,
        "type": "InferReply",
        **{k: v for k, v in common(seq=0).items()},
        "logits": {"dtype": "float32", "shape": [10**6, 10**6], "data": ref(0, 4 * 10**12)},
    }
    tracemalloc.start()
    try:
        reason = reason_of(frame(header, bytes(64)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reason.startswith("InferReply.logits: data [0, 4000000000000) lies outside")
    assert peak < 1_000_000


def test_tensor_map_needs_exactly_dtype_shape_and_data() -> None:
    found = reason_of(activations_header(lambda t: t.update(strides=[1])))
    assert found == (
        "SmashedBatch.activations: tensor map needs keys ['data', 'dtype', 'shape'], "
        "has ['data', 'dtype', 'shape', 'strides']"
    )
    found = reason_of(forged(smashed(), lambda h: h.update(activations=[1, 2])))
    assert found == "SmashedBatch.activations: expected a tensor map, got list"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x00" * 16, "data must be a tensor reference, msgpack ext 1"),
        (msgpack.ExtType(2, bytes(16)), "data must be a tensor reference, msgpack ext 1"),
        (msgpack.ExtType(1, bytes(8)), "tensor reference has 8 bytes, expected 16"),
    ],
)
def test_data_must_be_a_tensor_reference(data: object, reason: str) -> None:
    # bin values in the header are refused by msgpack itself, before the schema sees them.
    found = reason_of(activations_header(lambda t: t.update(data=data)))
    assert found == f"SmashedBatch.activations: {reason}" or (
        isinstance(data, bytes) and found.startswith("header is not valid msgpack")
    ), found


def test_data_outside_the_body() -> None:
    message = smashed(rows=2)  # activations [0, 96), labels [128, 144)
    body = encode(message)
    found = reason_of(body[:-1])
    assert found == "SmashedBatch.labels: data [128, 144) lies outside the 143-byte data section"

    def far(header: dict[str, Any]) -> None:
        header["labels"]["data"] = ref(2**63, 16)

    assert reason_of(forged(message, far)).startswith(
        "SmashedBatch.labels: data [9223372036854775808"
    )


def test_overlapping_misaligned_and_gapped_data() -> None:
    message = smashed(rows=2)

    def overlap(header: dict[str, Any]) -> None:
        header["labels"]["data"] = ref(64, 16)

    assert reason_of(forged(message, overlap)) == (
        "SmashedBatch.labels: data [64, 80) overlaps SmashedBatch.activations"
    )

    def misalign(header: dict[str, Any]) -> None:
        header["labels"]["data"] = ref(100, 16)

    assert reason_of(forged(message, misalign)) == (
        "SmashedBatch.labels: data [100, 116) is not 64-byte aligned"
    )

    def gap(header: dict[str, Any]) -> None:
        header["labels"]["data"] = ref(192, 16)

    assert reason_of(forged(message, gap)) == (
        "SmashedBatch.labels: data [192, 208) leaves a gap: expected offset 128"
    )

    def swap(header: dict[str, Any]) -> None:
        header["labels"]["data"], header["activations"]["data"] = ref(0, 16), ref(64, 96)

    # Swapped order is fine for the layout but not for the bytes: 96 bytes after 16 bytes.
    assert reason_of(forged(message, swap)) == (
        "SmashedBatch.activations: data [64, 160) lies outside the 144-byte data section"
    )


def test_empty_tensor_must_point_at_offset_zero() -> None:
    update = WeightsUpdate(
        **common(round=1, samples=1, client_weights={"e": torch.zeros(0, 3)}, aux_weights={})
    )

    def move(header: dict[str, Any]) -> None:
        header["client_weights"]["e"]["data"] = ref(64, 0)

    assert reason_of(forged(update, move)) == (
        "WeightsUpdate.client_weights['e']: empty tensor has offset 64, expected 0"
    )


def test_trailing_bytes_are_refused() -> None:
    for body in (encode(smashed(rows=2)), encode(Leave(**common()))):
        expected = f"body has {len(body) + 1} bytes, its layout accounts for {len(body)}"
        assert reason_of(body + b"\0") == expected


def test_bool_tensor_bytes_must_be_zero_or_one() -> None:
    masks = {"m": torch.ones(3) > 0}
    update = WeightsUpdate(
        **common(round=1, samples=1, client_weights={}, aux_weights={}, masks=masks)
    )
    body = bytearray(encode(update))
    body[-2] = 2
    assert reason_of(bytes(body)) == (
        "WeightsUpdate.masks['m']: bool tensor holds bytes other than 0 and 1"
    )


def test_labels_must_match_activation_rows() -> None:
    with pytest.raises(EncodeError, match=r"labels: shape \[3\] does not match 4 activation rows"):
        encode(smashed(rows=4, labels=torch.zeros(3, dtype=torch.int64)))
    valid = smashed(rows=4, labels=torch.zeros(4, dtype=torch.int64))

    def fewer(header: dict[str, Any]) -> None:
        header["labels"]["shape"] = [3]
        header["labels"]["data"] = ref(192, 24)

    body = forged(valid, fewer)
    assert reason_of(body[:-8]) == "SmashedBatch.labels: shape [3] does not match 4 activation rows"


# --- limits -------------------------------------------------------------------------------------


def test_oversize_body_is_refused_both_ways() -> None:
    message = smashed(rows=64)
    body = encode(message)
    limits = CodecLimits(max_body_bytes=len(body) - 1)
    assert reason_of(body, limits) == (
        f"body of {len(body)} bytes exceeds the limit of {len(body) - 1}"
    )
    with pytest.raises(EncodeError, match="exceeds the limit"):
        encode(message, limits)
    assert_same(decode(body, CodecLimits(max_body_bytes=len(body))), message)


def test_limits_on_tensors_strings_maps_and_header() -> None:
    update = next(m for m in all_messages() if isinstance(m, WeightsUpdate))  # 8 tensors
    body = encode(update)
    assert "more than 5 tensors" in reason_of(body, CodecLimits(max_tensors=5))
    with pytest.raises(EncodeError, match="more than 5 tensors"):
        encode(update, CodecLimits(max_tensors=5))
    assert reason_of(body, CodecLimits(max_dict_entries=1)) == (
        "WeightsUpdate.client_weights: 6 entries exceed the limit of 1"
    )
    join = Join(**common(samples=1, info={"note": "x" * 100}))
    assert "header is not valid msgpack" in reason_of(encode(join), CodecLimits(max_string_len=50))
    with pytest.raises(EncodeError, match=r"Join.info\['note'\]: string of 100 bytes exceeds"):
        encode(join, CodecLimits(max_string_len=50))
    with pytest.raises(EncodeError, match=r"Join\.info: 1 entries exceed the limit of 0"):
        encode(join, CodecLimits(max_dict_entries=0))
    assert reason_of(encode(join), CodecLimits(max_header_bytes=10)).startswith("header of ")


def test_map_limits_hold_in_msgpack_and_in_the_schema() -> None:
    body = encode(Join(**common(samples=1, info={f"k{i}": "v" for i in range(50)})))
    assert reason_of(body, CodecLimits(max_dict_entries=10)) == (
        "Join.info: 50 entries exceed the limit of 10"
    )
    # msgpack's own bound (never below 64) stops a huge map before it is built.
    big = encode(Join(**common(samples=1, info={f"k{i}": "v" for i in range(100)})))
    assert reason_of(big, CodecLimits(max_dict_entries=10)).startswith(
        "header is not valid msgpack"
    )


# --- encode-side validation ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: smashed(activations=torch.zeros(4, 2, dtype=torch.complex64)), "cannot travel"),
        (lambda: smashed(activations=torch.zeros(4, 2).to(torch.float8_e4m3fn)), "cannot travel"),
        (lambda: smashed(activations=torch.zeros(4, 2, dtype=torch.float64)), "not allowed here"),
        (lambda: smashed(activations=torch.zeros(4, 2).to_sparse()), "cannot travel"),
        (lambda: smashed(activations=[[0.0]]), "expected a tensor, got list"),
        (lambda: smashed(seq=True), "SmashedBatch.seq: expected int, got bool"),
        (lambda: smashed(seq="1"), "SmashedBatch.seq: expected int, got str"),
        (lambda: smashed(seq=-2), "SmashedBatch.seq: -2 must be >= 0"),
        (lambda: smashed(seq=2**63), "outside the int64 range"),
        (lambda: smashed(job=""), "SmashedBatch.job: must not be empty"),
        (lambda: smashed(client="\ud800"), "not encodable as UTF-8"),
        (lambda: Join(**common(samples=1, info={1: "x"})), "key 1 is not a string"),
        (lambda: Join(**common(samples=1, info=[("a", "b")])), "expected a map, got list"),
    ],
)
def test_encode_refuses_invalid_messages(build: Callable[[], Message], match: str) -> None:
    with pytest.raises(EncodeError, match=match):
        encode(build())


def test_encode_refuses_foreign_objects() -> None:
    @dataclasses.dataclass
    class Leave2:
        job: str

    with pytest.raises(EncodeError, match="Leave2 is not a SplitMQ message type"):
        encode(Leave2("j"))  # type: ignore[arg-type]
    with pytest.raises(EncodeError, match="dict is not a SplitMQ message type"):
        encode({"type": "Leave"})  # type: ignore[arg-type]


def test_messages_without_tensors_compare_by_value() -> None:
    message = Join(**common(samples=2, info={"a": "b"}))
    assert decode(encode(message)) == message


# --- schema and hygiene -------------------------------------------------------------------------


def test_schema_refuses_annotations_it_cannot_carry() -> None:
    # make_dataclass: this module's own annotations are strings (future import).
    odd = dataclasses.make_dataclass("Odd", [("when", complex)])
    with pytest.raises(TypeError, match=r"Odd\.when: no wire kind"):
        build_schema(odd)
    stringly = dataclasses.make_dataclass("Stringly", [("n", "int")])
    with pytest.raises(TypeError, match="no wire kind"):
        build_schema(stringly)
    bare = dataclasses.make_dataclass("Bare", [("t", torch.Tensor)])
    with pytest.raises(TypeError, match=r"Bare\.t: a tensor field needs exactly one TensorRule"):
        build_schema(bare)
    fine = dataclasses.make_dataclass(
        "Fine",
        [("n", Annotated[int, Marker.NON_NEGATIVE]), ("s", Annotated[str, Marker.NON_EMPTY])],
    )
    n, s = build_schema(fine).fields
    assert n.checks[0](-1, n.path, 10) == "Fine.n: -1 must be >= 0"
    assert s.checks[0]("", s.path, 10) == "Fine.s: must not be empty"


@pytest.mark.parametrize("walker", [Writer, Reader])
def test_the_fast_path_changes_no_outcome(walker: type[Writer] | type[Reader]) -> None:
    # Every scalar field of every message type, given each value: `Walker.fields` (its inline
    # test, else the long way) answers exactly as the long way alone does.
    values: list[object] = [0, -1, 7, 2**63, -(2**63) - 1, True, 1.5, math.nan, -math.inf]
    values += ["", "ok", "stale", "aborted", "x" * 70, "\u00e9", "\ud800", None, b"b", 2.0]
    limits = dataclasses.replace(DEFAULT_LIMITS, max_string_len=64)

    def outcome(run: Callable[..., object], *args: object) -> str:
        try:
            result = run(*args)
        except (EncodeError, DecodeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return f"{type(result).__name__}: {result!r}"

    checked = 0
    for schema in SCHEMAS.values():
        for spec in schema.fields:
            if spec.exact is None:
                continue
            alone = dataclasses.replace(schema, fields=(spec,))
            for value in values:
                fast = outcome(lambda *a: walker(limits).fields(*a)[0], alone, [value])
                slow = outcome(walker(limits).value, spec, value)
                assert fast == slow, (spec.path, value)
                checked += 1
    assert checked > 1000


def test_no_pickle_in_the_broker_package() -> None:
    forbidden = {"pickle", "_pickle", "cPickle", "cloudpickle", "dill", "marshal", "shelve"}
    for path in sorted(BROKER.glob("**/*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in forbidden, f"{path.name} imports {name}"
    for name in CODEC_MODULES:
        assert "pickle" not in (BROKER / name).read_text().lower(), name


def test_unanticipated_failures_still_surface_as_decode_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(message: object) -> str | None:
        raise RuntimeError("bug")

    body = encode(smashed())  # a type with cross-field checks: decode asks about it
    monkeypatch.setattr("broker.codec.consistency_error", broken)
    with pytest.raises(DecodeError) as info:
        decode(body)
    assert info.value.reason == f"{UNEXPECTED}RuntimeError: bug"
    assert isinstance(info.value.__cause__, RuntimeError)


def test_message_ids_are_fresh_128_bit_hex() -> None:
    ids = {new_message_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids)


def test_decode_with_expect_checks_the_type_before_the_tensors() -> None:
    body = encode(smashed())
    batch = decode(body, expect=SmashedBatch)
    assert isinstance(batch, SmashedBatch)
    assert isinstance(decode(body, expect=(RoundStart, SmashedBatch, RoundEnd)), SmashedBatch)
    with pytest.raises(UnexpectedMessageError) as refused:
        decode(body, expect=(RoundStart, RoundEnd))
    assert refused.value.type_name == "SmashedBatch"
    assert (
        refused.value.reason
        == "SmashedBatch does not belong here (expected RoundStart or RoundEnd)"
    )
    # Only the header is read: a body cut short inside its tensor data still names its type.
    with pytest.raises(UnexpectedMessageError):
        decode(body[: len(body) - 8], expect=GradientReply)
