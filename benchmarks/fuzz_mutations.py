"""Bad input for SplitMQ's consumers: byte-, header- and value-level mutations of encoded
messages, and well-formed messages that are wrong for the queue they are sent to.

Used by the bad-input table (`tests/unit/test_bad_input.py`) and the fuzz run
(`benchmarks/fuzz_services.py`). Every `Fuzzed` says what a consumer must do with it:

- `REJECT`: dead-letter it with an `x-splitmq-reason`. A byte or header mutation counts as one
  only if this process's own codec refuses it (`refused`); one that still decodes is dropped
  or retried, never guessed at.
- `TOLERATE`: a replay (an exact or bit-flipped copy of real traffic, a valid message the
  consumer recognises as a duplicate or as late). It must not crash anything or be applied
  twice; whether it is dead-lettered is the consumer's call.

The body layout is the codec's (`broker.codec`): magic, u32 header length, msgpack header,
zero padding to 64 bytes, tensor data. Mutations re-pack the header with msgpack's own ext
values, so the tensor references stay as they were unless a mutation changes them.
"""

from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from broker.codec import MAGIC, decode, encode
from broker.errors import DecodeError
from broker.messages import (
    Error,
    Event,
    GradientReply,
    Heartbeat,
    InferReply,
    InferRequest,
    Join,
    Leave,
    Message,
    RoundEnd,
    RoundStart,
    SmashedBatch,
    WeightsAssignment,
    WeightsUpdate,
    Welcome,
    new_message_id,
)

REJECT = "reject"
TOLERATE = "tolerate"

_PREFIX = struct.Struct("<4sI")
_REF = struct.Struct("<QQ")
_ALIGN = 64
_FLOAT_PATTERNS = {  # little-endian NaN and +Inf of each float dtype
    "float32": (b"\x00\x00\xc0\x7f", b"\x00\x00\x80\x7f"),
    "float16": (b"\x00\x7e", b"\x00\x7c"),
    "bfloat16": (b"\xc0\x7f", b"\x80\x7f"),
    "float64": (b"\x00\x00\x00\x00\x00\x00\xf8\x7f", b"\x00\x00\x00\x00\x00\x00\xf0\x7f"),
}
_FOREIGN_DTYPES = ("int32", "int64", "float64", "uint8", "complex64", "float8", "", "<f4")


@dataclass(frozen=True)
class Fuzzed:
    kind: str  # what was done, e.g. "flip", "header:dtype", "semantic:wrong_job"
    body: bytes
    expect: str = REJECT
    # The AMQP user_id to publish it with (impostor cases; None: none).
    user_id: str | None = None


def refused(body: bytes) -> bool:
    """Whether the codec refuses `body` (what every consumer does first)."""
    try:
        decode(body)
    except DecodeError:
        return True
    return False


# --- the layout -----------------------------------------------------------------------------


@dataclass
class Parts:
    header: dict[Any, Any]
    data: bytes  # the data section (after the padding), possibly empty


def split(body: bytes) -> Parts:
    """Header (ext values kept as msgpack ExtTypes) and data section of a valid body."""
    _, length = _PREFIX.unpack_from(body)
    end = _PREFIX.size + length
    header = msgpack.unpackb(body[_PREFIX.size : end], raw=False, strict_map_key=False)
    start = _align(end)
    return Parts(header, body[start:] if start < len(body) else b"")


def assemble(parts: Parts) -> bytes:
    packed = msgpack.packb(parts.header, use_bin_type=True)
    prefix = _PREFIX.pack(MAGIC, len(packed)) + packed
    if not parts.data:
        return prefix
    return prefix + bytes(_align(len(prefix)) - len(prefix)) + parts.data


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Span:
    path: tuple[Any, ...]  # keys from the header root to the tensor map
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the body
    nbytes: int


def tensors(body: bytes) -> list[Span]:
    """Every tensor of a valid body, with where its bytes are."""
    _, length = _PREFIX.unpack_from(body)
    data_start = _align(_PREFIX.size + length)
    found: list[Span] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, dict):
            ref = node.get("data")
            if isinstance(ref, msgpack.ExtType) and set(node) == {"dtype", "shape", "data"}:
                offset, nbytes = _REF.unpack(ref.data)
                shape = tuple(int(d) for d in node["shape"])
                found.append(Span(path, str(node["dtype"]), shape, data_start + offset, nbytes))
                return
            for key, value in node.items():
                walk(value, (*path, key))

    walk(split(body).header, ())
    return found


def _node(header: dict[Any, Any], path: tuple[Any, ...]) -> dict[Any, Any]:
    node: Any = header
    for key in path:
        node = node[key]
    assert isinstance(node, dict)
    return node


# --- byte-level mutations (rejected by the codec) ---------------------------------------------


def random_bytes(rng: random.Random, _body: bytes = b"") -> bytes:
    return rng.randbytes(rng.choice((0, 1, 7, 8, 63, 200, 4096)))


def truncated(rng: random.Random, body: bytes) -> bytes:
    return body[: rng.randrange(len(body))] if body else b""


def extended(rng: random.Random, body: bytes) -> bytes:
    return body + rng.randbytes(rng.randint(1, 128))


def flipped(rng: random.Random, body: bytes) -> bytes:
    """A few bytes of the prefix and header flipped (the data section rarely breaks a body)."""
    if not body:
        return b"\xff"
    out = bytearray(body)
    _, length = _PREFIX.unpack_from(body)
    header_end = min(len(out), _PREFIX.size + length)
    for _ in range(rng.randint(1, 4)):
        i = rng.randrange(header_end)
        out[i] ^= 1 << rng.randrange(8)
    return bytes(out)


def bad_magic(rng: random.Random, body: bytes) -> bytes:
    return rng.choice((b"SMQ\x02", b"\x00\x00\x00\x00", b"PK\x03\x04")) + body[4:]


def length_lie(rng: random.Random, body: bytes) -> bytes:
    """The prefix announces a header longer than the body, or beyond the codec's limit."""
    _, length = _PREFIX.unpack_from(body)
    lie = rng.choice((length + len(body), 5 * 2**20, 2**32 - 1))
    return _PREFIX.pack(MAGIC, lie) + body[_PREFIX.size :]


def header_bomb(rng: random.Random, _body: bytes = b"") -> bytes:
    """A small header that claims a huge map or string (msgpack reads the claim first)."""
    claims = (b"\xdf\xff\xff\xff\xff", b"\xdb\x00\x10\x00\x00abc", b"\xdd\x7f\xff\xff\xff")
    header = rng.choice(claims)
    return _PREFIX.pack(MAGIC, len(header)) + header


BYTE_MUTATORS: Mapping[str, Callable[[random.Random, bytes], bytes]] = {
    "random": random_bytes,
    "truncate": truncated,
    "extend": extended,
    "flip": flipped,
    "magic": bad_magic,
    "length": length_lie,
    "bomb": header_bomb,
}


# --- header-level mutations ---------------------------------------------------------------------


def _header_dtype(rng: random.Random, parts: Parts, spans: Sequence[Span]) -> None:
    span = rng.choice(spans)
    _node(parts.header, span.path)["dtype"] = rng.choice(_FOREIGN_DTYPES)


def _header_shape(rng: random.Random, parts: Parts, spans: Sequence[Span]) -> None:
    node = _node(parts.header, rng.choice(spans).path)
    shape = list(node["shape"])
    choice = rng.randrange(5)
    if choice == 0 and shape:
        shape[rng.randrange(len(shape))] *= rng.choice((2, 64, 2**40))
    elif choice == 1:
        shape.append(rng.choice((2, 3)))
    elif choice == 2 and shape:
        shape[rng.randrange(len(shape))] = -1
    elif choice == 3:
        shape = [1] * 9  # beyond the codec's maximum rank
    else:
        shape = ["x", None]
    node["shape"] = shape


def _header_field(rng: random.Random, parts: Parts, _spans: Sequence[Span]) -> None:
    header = parts.header
    names = [k for k in header if k not in ("v", "type")]
    choice = rng.randrange(4)
    if choice == 0 and names:
        del header[rng.choice(names)]
    elif choice == 1:
        header[rng.choice(("surprise", "evil", "__class__"))] = 1
    elif names:
        header[rng.choice(names)] = rng.choice((-1, 2**70, 1.5, [1, 2], {"a": 1}, b"\x00"))
    else:
        header["v"] = 2


def _header_type(rng: random.Random, parts: Parts, _spans: Sequence[Span]) -> None:
    header = parts.header
    choice = rng.randrange(3)
    if choice == 0:
        header["type"] = rng.choice(("Nope", "", "join", "Welcome ", 7))
    elif choice == 1:
        header["v"] = rng.choice((0, 2, "1", None))
    else:
        header["type"] = rng.choice(("Join", "SmashedBatch", "WeightsUpdate", "Event"))


HEADER_MUTATORS = {
    "header:dtype": _header_dtype,
    "header:shape": _header_shape,
    "header:field": _header_field,
    "header:type": _header_type,
}


def header_mutation(rng: random.Random, body: bytes, name: str) -> bytes:
    parts = split(body)
    spans = tensors(body)
    if name in ("header:dtype", "header:shape") and not spans:
        name = "header:field"
    HEADER_MUTATORS[name](rng, parts, spans)
    return assemble(parts)


def poisoned(body: bytes, *, infinity: bool = False) -> bytes:
    """The first element of the first float tensor set to NaN (or +Inf)."""
    for span in tensors(body):
        patterns = _FLOAT_PATTERNS.get(span.dtype)
        if patterns and span.nbytes:
            value = patterns[1 if infinity else 0]
            out = bytearray(body)
            out[span.start : span.start + len(value)] = value
            return bytes(out)
    raise ValueError("no float tensor to poison")


def mutations(rng: random.Random, seed: bytes, *, tries: int = 16) -> Fuzzed:
    """One mutation of `seed` that the codec refuses (NaN, byte or header level)."""
    names = [*BYTE_MUTATORS, *HEADER_MUTATORS, "nan", "inf"]
    for _ in range(tries):
        name = rng.choice(names)
        try:
            if name in BYTE_MUTATORS:
                body = BYTE_MUTATORS[name](rng, seed)
            elif name in HEADER_MUTATORS:
                body = header_mutation(rng, seed, name)
            else:
                body = poisoned(seed, infinity=name == "inf")
        except (ValueError, struct.error, msgpack.PackException, TypeError):
            continue  # not applicable to this seed
        if refused(body):
            return Fuzzed(name, body)
    # Nothing applicable was refused (a seed without tensors, say): bytes that cannot decode.
    return Fuzzed("magic", b"\x00MQ\x01" + seed[4:])


def flipped_data(rng: random.Random, body: bytes) -> Fuzzed:
    """A replay whose tensor bytes got a bit flipped: valid or not, the codec decides."""
    spans = [s for s in tensors(body) if s.nbytes]
    if not spans:
        return Fuzzed("replay", body, TOLERATE)
    span = rng.choice(spans)
    out = bytearray(body)
    i = span.start + rng.randrange(span.nbytes)
    out[i] ^= 1 << rng.randrange(8)
    mutated = bytes(out)
    return Fuzzed("replay:flip-data", mutated, REJECT if refused(mutated) else TOLERATE)


# --- well-formed messages that are wrong where they are sent ------------------------------------


@dataclass(frozen=True)
class Context:
    """What a consumer of one job expects: enough to build right and wrong messages."""

    job: str
    cut_shape: tuple[int, ...]
    num_classes: int
    client_weights: Mapping[str, torch.Tensor]  # names and shapes of the client blob
    members: Sequence[str] = ()

    def ghost(self, rng: random.Random) -> str:
        return f"ghost-{rng.randrange(1 << 30):x}"


def activations(ctx: Context, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, *ctx.cut_shape)


def labels(ctx: Context, rows: int = 4) -> torch.Tensor:
    return torch.randint(0, ctx.num_classes, (rows,))


def sample_messages(ctx: Context, client: str, rng: random.Random) -> list[Message]:
    """One valid message of every type (the seeds of mutation)."""
    job, mid = ctx.job, new_message_id
    z, y = activations(ctx), labels(ctx)
    weights = {n: t.clone() for n, t in ctx.client_weights.items()}
    seq = rng.randrange(1 << 40)
    return [
        Join(job, client, mid(), 1, 100, 0, {"index": "0", "classes": "0,1"}),
        Welcome(job, client, mid(), 1, 0, "block1", 0, weights, {}, {"algorithm": "sfl"}),
        Leave(job, client, mid(), 1, "fuzz"),
        Heartbeat(job, client, mid(), 1),
        SmashedBatch(job, client, mid(), 1, seq, 0, 0, 0, z, y, steps=1),
        GradientReply(job, client, mid(), 1, seq, "ok", 0.5, 2, 4, torch.randn_like(z)),
        WeightsUpdate(job, client, mid(), 1, 0, 100, weights, {}, metrics={"train_loss": 1.0}),
        WeightsAssignment(job, client, mid(), 1, 0, True, weights, {}, {"lr": 0.1}),
        InferRequest(job, client, mid(), 1, seq, z),
        InferReply(job, client, mid(), 1, seq, torch.randn(4, ctx.num_classes)),
        Error(job, client, mid(), 1, "fuzz", "a fuzzed error"),
        RoundStart(job, "", mid(), 1, 0, 0, {client: 100}),
        RoundEnd(job, "", mid(), 1, 0, 0),
        Event(job, "", mid(), 1, "fuzz", {"x": 1}),
    ]


def _enc(message: Message) -> bytes:
    return encode(message)


def _wrong_types(
    ctx: Context, rng: random.Random, allowed: tuple[type[Message], ...]
) -> list[Fuzzed]:
    seeds = sample_messages(ctx, rng.choice([*ctx.members, "c0"]), rng)
    return [
        Fuzzed(f"semantic:wrong_type:{type(m).__name__}", _enc(m))
        for m in seeds
        if not isinstance(m, allowed)
    ]


def shard_cases(ctx: Context, shard: int, rng: random.Random, version: int) -> list[Fuzzed]:
    """Well-formed messages a shard queue must refuse. `version`: the published one."""
    job, mid = ctx.job, new_message_id
    ghost = ctx.ghost(rng)
    member = rng.choice(list(ctx.members)) if ctx.members else "c0"
    z, y = activations(ctx), labels(ctx)
    far = 10**6

    def batch(**changes: Any) -> SmashedBatch:
        base = SmashedBatch(job, ghost, mid(), version, rng.randrange(1 << 40), shard, far, 0, z, y)
        return dataclasses.replace(base, **changes)

    wrong_shape = torch.randn(4, *(d + 1 for d in ctx.cut_shape))
    out = [
        Fuzzed("semantic:wrong_job", _enc(batch(job=job + "-other"))),
        Fuzzed("semantic:wrong_shard", _enc(batch(shard=shard + 1 + rng.randrange(3)))),
        Fuzzed("semantic:bad_client_id", _enc(batch(client="x" * 300))),
        Fuzzed("semantic:bad_client_id", _enc(batch(client="../etc"))),
        Fuzzed("semantic:unknown_client", _enc(batch())),
        Fuzzed("semantic:wrong_shape", _enc(batch(client=member, activations=wrong_shape))),
        Fuzzed(
            "semantic:oversized",
            _enc(batch(activations=activations(ctx, 64), labels=labels(ctx, 64))),
        ),
        Fuzzed(
            "semantic:labels",
            _enc(batch(client=member, labels=torch.full((4,), ctx.num_classes + 3))),
        ),
        Fuzzed("semantic:bad_cut", _enc(batch(client=member, cut="no_such_block"))),
        Fuzzed("semantic:marker_round", _enc(RoundEnd(job, "", mid(), version, version, shard))),
        Fuzzed(
            "semantic:marker_future",
            _enc(RoundStart(job, "", mid(), version + far, version, shard, {ghost: 10})),
        ),
        Fuzzed("semantic:marker_job", _enc(RoundEnd(job + "x", "", mid(), 1, 0, shard))),
        Fuzzed("semantic:marker_cohort", _enc(RoundStart(job, "", mid(), 1, 0, shard, {"": 1}))),
        Fuzzed("semantic:nan", poisoned(_enc(batch(client=member)))),
    ]
    out += _wrong_types(ctx, rng, (SmashedBatch, RoundStart, RoundEnd))
    return out


def infer_cases(ctx: Context, rng: random.Random) -> list[Fuzzed]:
    job, mid = ctx.job, new_message_id
    ghost = ctx.ghost(rng)
    z = activations(ctx)
    out = [
        Fuzzed("semantic:wrong_job", _enc(InferRequest(job + "-x", ghost, mid(), 0, 1, z))),
        Fuzzed("semantic:bad_client_id", _enc(InferRequest(job, "a.b" * 30, mid(), 0, 1, z))),
        Fuzzed(
            "semantic:wrong_shape",
            _enc(InferRequest(job, ghost, mid(), 0, 1, torch.randn(2, 3, 5))),
        ),
        Fuzzed("semantic:no_reply_queue", _enc(InferRequest(job, ghost, mid(), 0, 1, z))),
        Fuzzed("semantic:nan", poisoned(_enc(InferRequest(job, ghost, mid(), 0, 1, z)))),
    ]
    out += _wrong_types(ctx, rng, (InferRequest,))
    return out


def control_cases(ctx: Context, rng: random.Random) -> list[Fuzzed]:
    job, mid = ctx.job, new_message_id
    ghost = ctx.ghost(rng)
    out = [
        Fuzzed("semantic:wrong_job", _enc(Join(job + "-x", ghost, mid(), 0, 10))),
        Fuzzed("semantic:bad_client_id", _enc(Join(job, "ü" * 20, mid(), 0, 10))),
        Fuzzed("semantic:bad_client_id", _enc(Heartbeat(job, "", mid(), 0))),
        Fuzzed("semantic:unknown_client", _enc(Join(job, ghost, mid(), 0, 10, 0, {"index": "0"}))),
        Fuzzed("semantic:unknown_client", _enc(Heartbeat(job, ghost, mid(), 0))),
        Fuzzed("semantic:unknown_client", _enc(Leave(job, ghost, mid(), 0, "fuzz"))),
        Fuzzed("semantic:role", _enc(Heartbeat(job, ghost, mid(), 0, role="worker"))),
    ]
    out += _wrong_types(ctx, rng, (Join, Leave, Heartbeat))
    return out


def update_cases(ctx: Context, rng: random.Random) -> list[Fuzzed]:
    job, mid = ctx.job, new_message_id
    ghost = ctx.ghost(rng)
    member = rng.choice(list(ctx.members)) if ctx.members else ghost
    names = {f"{n}.evil": t for n, t in ctx.client_weights.items()}
    shapes = {
        n: torch.zeros(tuple(d + 1 for d in t.shape) or (2,)) for n, t in ctx.client_weights.items()
    }
    future = 10**6

    def update(**changes: Any) -> WeightsUpdate:
        base = WeightsUpdate(job, member, mid(), 1, future, 10, dict(ctx.client_weights), {})
        return dataclasses.replace(base, **changes)

    out = [
        Fuzzed("semantic:wrong_job", _enc(update(job=job + "-x"))),
        Fuzzed("semantic:bad_client_id", _enc(update(client="bad id"))),
        Fuzzed("semantic:tensor_names", _enc(update(client_weights=names))),
        Fuzzed("semantic:tensor_shapes", _enc(update(client_weights=shapes))),
        Fuzzed("semantic:unknown_client", _enc(update(client=ghost, round=0))),
        Fuzzed("semantic:round_not_open", _enc(update())),
        Fuzzed("semantic:nan", poisoned(_enc(update()))),
    ]
    out += _wrong_types(ctx, rng, (WeightsUpdate,))
    return out


def reply_cases(ctx: Context, client: str, rng: random.Random) -> list[Fuzzed]:
    """Well-formed messages a client's reply queue must refuse."""
    job, mid = ctx.job, new_message_id
    bad_weights = {"blocks.0.evil": torch.zeros(3)}
    out = [
        Fuzzed("semantic:wrong_job", _enc(Error(job + "-x", client, mid(), 0, "x", "y"))),
        Fuzzed("semantic:other_client", _enc(Error(job, client + "-other", mid(), 0, "x", "y"))),
        Fuzzed(
            "semantic:tensor_names",
            _enc(Welcome(job, client, mid(), 1, 0, "block1", 0, bad_weights, {}, {})),
        ),
        Fuzzed(
            "semantic:bad_config",
            _enc(WeightsAssignment(job, client, mid(), 1, 0, True, {}, {}, {"batch_size": -4})),
        ),
    ]
    allowed = (Welcome, WeightsAssignment, GradientReply, Error, InferReply)
    out += _wrong_types(dataclasses.replace(ctx, members=(client,)), rng, allowed)
    return out


def event_cases(ctx: Context, rng: random.Random) -> list[Fuzzed]:
    return _wrong_types(ctx, rng, (Event,))
