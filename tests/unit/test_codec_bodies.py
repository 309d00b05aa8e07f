"""Bodies written in place (`broker.bodies`) against bodies joined from their parts.

`encode` writes bodies of at least `_IN_PLACE` bytes into a fresh `bytes` through a numpy
window, checking tensors piece by piece as it copies them; smaller ones, and every body where
`fresh_body` is unavailable, are joined. Both must give the same bytes and the same refusals.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

import broker.codec
from broker.bodies import fresh_body
from broker.codec import _IN_PLACE, decode, encode, encode_into
from broker.errors import EncodeError
from broker.messages import Message, SmashedBatch, WeightsUpdate
from broker.tensors import _CHUNK


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


def test_fresh_body_is_an_ordinary_bytes_once_filled() -> None:
    made = fresh_body(1000)
    assert made is not None
    body, window = made
    window[:] = np.frombuffer(bytes(range(250)) * 4, np.uint8)
    del window
    expected = bytes(range(250)) * 4
    assert type(body) is bytes and body == expected and hash(body) == hash(expected)
    assert fresh_body(0) is None and fresh_body(1) is None  # CPython's shared singletons


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
