"""Message header tables: what may be sent, and what a received table is reduced to.

Both brokers check outgoing headers the same way so that a header the in-memory broker accepts
never fails later on RabbitMQ: AMQP field-table keys are short strings (at most 255 bytes) and
pika encodes only str, bytes, bool and 64-bit int among our `HeaderValue` types.
"""

from __future__ import annotations

from collections.abc import Mapping

from broker.errors import EncodeError
from broker.transport import Headers, HeaderValue

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_MAX_KEY_BYTES = 255


def outgoing_headers(headers: Headers | None) -> dict[str, HeaderValue] | None:
    """A checked copy of `headers` (None when empty); raises `EncodeError` on a bad entry."""
    if not headers:
        return None
    checked: dict[str, HeaderValue] = {}
    for key, value in headers.items():
        if not isinstance(key, str) or len(key.encode()) > _MAX_KEY_BYTES:
            raise EncodeError(f"header key {key!r} must be a str of at most 255 UTF-8 bytes")
        # bool is an int subclass; test it first so True is not range-checked as 1.
        if isinstance(value, bool | str | bytes):
            pass
        elif isinstance(value, int):
            if not _INT64_MIN <= value <= _INT64_MAX:
                raise EncodeError(f"header {key!r}: integer {value} does not fit in 64 bits")
        else:
            raise EncodeError(
                f"header {key!r}: unsupported type {type(value).__name__} (str, bytes, bool, int)"
            )
        checked[key] = value
    return checked


def incoming_headers(raw: Mapping[str, object] | None) -> dict[str, HeaderValue]:
    """The scalar entries of a received table.

    Tables, arrays, timestamps and decimals (RabbitMQ's ``x-death`` history, for one) are dropped:
    callers see only `HeaderValue`s. RabbitMQ's scalar ``x-first-death-*`` headers survive.
    """
    if not raw:
        return {}
    kept: dict[str, HeaderValue] = {}
    for key, value in raw.items():
        if isinstance(value, bool | str | bytes):
            kept[key] = value
        elif isinstance(value, int):
            # pika decodes 64-bit fields as its own int subclass; hand back a plain int.
            kept[key] = int(value)
    return kept
