"""What both brokers check before a publish, and what a received header table is reduced to.

Both check the same way so that a publish the in-memory broker accepts never fails later on
RabbitMQ: AMQP field-table keys are short strings (at most 255 bytes) and pika encodes only
str, bytes, bool and 64-bit int among our `HeaderValue` types.
"""

from __future__ import annotations

from collections.abc import Mapping

from broker.errors import BrokerError, EncodeError, MessageTooLargeError
from broker.transport import Headers, HeaderValue

_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_MAX_KEY_BYTES = 255


def check_publish(
    body: object, max_bytes: int, user_id: str | None, user: str | None, target: str
) -> None:
    """Refuse up front what the broker would refuse later (`target` names exchange and key):
    RabbitMQ answers an oversize body, or a user_id that is not the connection's `user`, by
    closing the channel."""
    if not isinstance(body, bytes):
        # The in-memory queue keeps a reference (a mutable buffer could change after the
        # publish); pika 1.4 turns any non-bytes body into bytes with str.encode.
        raise TypeError(f"body must be bytes, not {type(body).__name__}")
    if len(body) > max_bytes:
        raise MessageTooLargeError(
            f"body of {len(body)} bytes exceeds the broker's max_message_size of {max_bytes} "
            f"bytes ({target}); split the payload or raise the server limit"
        )
    if user_id is not None and user is not None and user_id != user:
        raise BrokerError(f"user_id {user_id!r} differs from this connection's user {user!r}")


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
