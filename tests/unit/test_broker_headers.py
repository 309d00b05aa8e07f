"""Header checks shared by both brokers: what RabbitMQ cannot carry is refused everywhere."""

from __future__ import annotations

import datetime
import decimal
from typing import Any

import pytest

from broker.errors import EncodeError
from broker.transport import incoming_headers, outgoing_headers


def test_supported_values_pass_as_a_copy() -> None:
    headers: dict[str, Any] = {"s": "x", "i": -(1 << 63), "b": False, "y": b"\x00"}

    checked = outgoing_headers(headers)

    assert checked == headers
    assert checked is not headers
    assert outgoing_headers({}) is None
    assert outgoing_headers(None) is None


@pytest.mark.parametrize(
    ("headers", "match"),
    [
        ({"f": 1.5}, "unsupported type float"),
        ({"n": None}, "unsupported type NoneType"),
        ({"big": 1 << 63}, "64 bits"),
        ({"k" * 256: "v"}, "255"),
        ({"nested": {"a": 1}}, "unsupported type dict"),
    ],
)
def test_unsupported_values_are_refused(headers: dict[str, Any], match: str) -> None:
    with pytest.raises(EncodeError, match=match):
        outgoing_headers(headers)


def test_received_tables_keep_only_scalars() -> None:
    class PikaLong(int):  # pika decodes 64-bit fields as an int subclass of its own
        pass

    raw: dict[str, object] = {
        "x-first-death-reason": "rejected",
        "count": PikaLong(3),
        "flag": True,
        "raw": b"\x01",
        "x-death": [{"count": 1, "reason": "rejected"}],
        "when": datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC),
        "price": decimal.Decimal("1.5"),
        "nothing": None,
    }

    kept = incoming_headers(raw)

    assert kept == {"x-first-death-reason": "rejected", "count": 3, "flag": True, "raw": b"\x01"}
    assert type(kept["count"]) is int
    assert kept["flag"] is True
    assert incoming_headers(None) == {}
