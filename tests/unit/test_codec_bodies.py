"""Bodies written in place (`broker.bodies`) against bodies joined from their parts.

`encode` writes bodies of at least `_IN_PLACE` bytes into a fresh `bytes` through a numpy
window, checking tensors piece by piece as it copies them; smaller ones, and every body where
`fresh_body` is unavailable (the probe failed, or `SPLITMQ_IN_PLACE_BODIES=0`), are joined.
Both must give the same bytes and the same refusals. Decoding a read-only body raises no
warning and leaves the warning filters alone.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

import broker.bodies
import broker.codec
from broker.bodies import SWITCH, enabled, fresh_body, probe
from broker.codec import _IN_PLACE, decode, encode, encode_into
from broker.errors import EncodeError
from broker.messages import Message, SmashedBatch, WeightsUpdate
from broker.tensors import _CHUNK, writable_alias


def common() -> dict[str, Any]:
    return {"job": "j", "client": "c", "message_id": "m", "version": 1}


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def big_messages() -> list[Message]:
    rows = _IN_PLACE // (256 * 4) + 3  # float32 activations just over the in-place threshold
    strided = randn(256, rows).t()
    tracked = randn(rows, 256).requires_grad_() * 1
    batches: list[Message] = [
        SmashedBatch(
            **common(),
            seq=1,
            shard=0,
            round=0,
            step=0,
            activations=activations,
            labels=torch.arange(rows) % 10,
        )
        for activations in (
            randn(rows, 256),
            strided,
            tracked,
            randn(rows, 512, dtype=torch.bfloat16),
        )
    ]
    return [
        *batches,
        WeightsUpdate(
            **common(),
            round=0,
            samples=1,
            client_weights={
                "w": randn(3 * _CHUNK // 4 + 5),  # pieces, the last one short
                "h": randn(700, 300, dtype=torch.float16),
                "n": torch.tensor(3),
                "e": torch.zeros(0, 2),
                "b": randn(7, seed=2),  # a padding gap behind it
            },
            aux_weights={"a": randn(3)},
        ),
    ]


@pytest.fixture
def joined(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `encode` join every body, as where `fresh_body` is unavailable."""
    monkeypatch.setattr(broker.codec, "fresh_body", lambda size: None)


@pytest.fixture
def verdict() -> Iterator[None]:
    """A test that changes what decides the trick has the probe run again, before and after."""
    broker.bodies._constructor_here.cache_clear()
    yield
    broker.bodies._constructor_here.cache_clear()


def test_the_trick_is_earned_here() -> None:
    assert probe() is None  # CPython: the write lands


def _constructor_of(body: Callable[[int], Any]) -> Callable[[], Callable[[None, int], bytes]]:
    return lambda: lambda _null, size: body(size)


def _raises(size: int) -> bytes:
    raise OSError("no such symbol")


@pytest.mark.parametrize(
    ("constructor", "reason"),
    [
        (_constructor_of(lambda size: bytearray(size)), "made bytearray"),
        (_constructor_of(lambda size: bytes(size - 1)), "of 4098 bytes"),
        (_constructor_of(_raises), "OSError: no such symbol"),
    ],
)
def test_the_probe_says_why_the_trick_fails(
    constructor: Callable[[], Callable[[None, int], bytes]], reason: str
) -> None:
    assert reason in str(probe(constructor))


def test_the_switch_turns_the_trick_off_without_probing() -> None:
    def unused() -> str | None:
        raise AssertionError("probed although switched off")

    for value in ("0", "false", "OFF", " no "):
        assert not enabled({SWITCH: value}, unused)
    assert enabled({}, lambda: None) and enabled({SWITCH: "1"}, lambda: None)
    assert not enabled({}, lambda: "not CPython")


@pytest.mark.usefixtures("verdict")
@pytest.mark.parametrize("how", ["switched off", "probe fails"])
def test_without_the_trick_bodies_are_joined_and_the_same(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    messages = big_messages()
    in_place = [encode(message) for message in messages]
    broker.bodies._constructor_here.cache_clear()
    if how == "switched off":
        monkeypatch.setenv(SWITCH, "0")
    else:
        monkeypatch.setattr(broker.bodies, "probe", lambda: "not today")
    assert fresh_body(_IN_PLACE) is None
    assert [encode(message) for message in messages] == in_place


def test_a_writable_alias_keeps_its_buffer_alive() -> None:
    alias = writable_alias(b"".join([b"ab", b"cd"]))
    assert alias.flags.writeable and bytes(alias) == b"abcd"
    # A decoded tensor outlives every other reference to its body.
    expected = randn(300, 7, seed=4)
    message = decode(
        encode(
            WeightsUpdate(
                **common(), round=0, samples=1, client_weights={"w": expected}, aux_weights={}
            )
        )
    )
    gc.collect()
    assert isinstance(message, WeightsUpdate)
    assert torch.equal(message.client_weights["w"], expected)


def test_fresh_body_is_an_ordinary_bytes_once_filled() -> None:
    made = fresh_body(1000)
    assert made is not None
    body, window = made
    window[:] = np.frombuffer(bytes(range(250)) * 4, np.uint8)
    del window
    expected = bytes(range(250)) * 4
    assert type(body) is bytes and body == expected and hash(body) == hash(expected)
    assert fresh_body(0) is None and fresh_body(1) is None  # CPython's shared singletons


def test_decoding_a_read_only_body_warns_nothing_and_leaves_the_filters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch warns once per process, so the absence of a warning alone proves little here: what
    # torch is given (writable arrays) and the filters while it is called are checked instead.
    seen: list[tuple[bool, list[Any]]] = []
    from_numpy = torch.from_numpy

    def watched(array: np.ndarray[Any, Any]) -> torch.Tensor:
        seen.append((array.flags.writeable, list(warnings.filters)))
        return from_numpy(array)

    monkeypatch.setattr(torch, "from_numpy", watched)
    body = encode(big_messages()[-1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        filters = warnings.filters
        before = list(filters)
        message = decode(body)
        assert warnings.filters is filters and filters == before
    assert caught == [] and len(seen) == 5
    assert all(writable and during == before for writable, during in seen)
    assert isinstance(message, WeightsUpdate)
    assert bytes(message.client_weights["b"].numpy()) == bytes(randn(7, seed=2).numpy())


def test_the_first_decode_of_a_process_warns_nothing() -> None:
    # torch warns about a read-only array once per process: only a fresh one can show it.
    script = (
        "import torch; from broker.codec import decode, encode; from broker.messages import "
        "SmashedBatch as S; decode(encode(S(job='j', client='c', message_id='m', version=1, "
        "seq=1, shard=0, round=0, step=0, activations=torch.ones(4, 3), labels=torch.ones(4, "
        "dtype=torch.int64))))"
    )
    subprocess.run([sys.executable, "-W", "error", "-c", script], check=True, timeout=120)


@pytest.mark.parametrize("index", range(len(big_messages())))
def test_big_bodies_are_the_same_written_in_place_or_joined(
    index: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = big_messages()[index]
    in_place = encode(message)
    assert len(in_place) >= _IN_PLACE
    monkeypatch.setattr(broker.codec, "fresh_body", lambda size: None)
    assert encode(message) == in_place
    view = encode_into(message, bytearray(b"\xff" * (len(in_place) + 100)))  # stale bytes
    assert bytes(view) == in_place
    assert type(decode(in_place)) is type(message)


@pytest.mark.parametrize("path", ["in place", "joined"])
@pytest.mark.parametrize("where", [0, _CHUNK // 4 - 1, _CHUNK // 4, -1])
def test_a_bad_value_is_refused_on_either_path(
    path: str, where: int, request: pytest.FixtureRequest
) -> None:
    if path == "joined":
        request.getfixturevalue("joined")
    message = big_messages()[0]
    assert isinstance(message, SmashedBatch)
    message.activations.view(-1)[where] = -math.inf
    with pytest.raises(EncodeError, match=r"SmashedBatch\.activations: holds NaN or infinite"):
        encode(message)


def test_a_refused_encode_into_leaves_the_buffer_free_to_grow() -> None:
    # The window over the buffer pins its size; a refusal must not leave one behind.
    bad = big_messages()[0]
    assert isinstance(bad, SmashedBatch)
    bad.activations.view(-1)[-1] = math.nan
    buffer = bytearray()
    with pytest.raises(EncodeError, match="holds NaN or infinite values"):
        encode_into(bad, buffer)
    bigger = big_messages()[-1]
    encode_into(bigger, buffer).release()
    assert len(buffer) >= len(encode(bigger))
