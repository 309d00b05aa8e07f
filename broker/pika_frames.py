"""A frame reader and writer for pika connections that copy each message body once.

pika 1.x reads the socket 4 KiB at a time into a `bytes` buffer it re-slices after every
frame (`+=`, then `buffer[n:]`), and publishes by slicing the body into frames and joining
each slice with its frame header: a 360 KiB body was copied ~5 times on receipt and twice on
publish, a 16 MiB one ~130 times on receipt. `tune_frames` replaces both on one connection:
a read of up to `RECV_BYTES` is parsed in place (body fragments are views into it, joined
once by pika into the message body; only a frame cut by the end of a read is copied to
complete it), and a publish is one buffer of all its frames, sent without further copies
(docs/benchmarks.md, "SFL-V2 throughput"). On a plain TCP connection, output is also sent at
once (`_send_now`).

This relies on pika's private code, as it is in every version in `SUPPORTED` (compared
against pika's own source for each):

- `pika.connection.Connection`: `_on_data_available(data)` (replaced by `_FrameReader.feed`)
  with its `_frame_buffer` (bytes), `_process_frame(frame)`, `bytes_received`;
  `_send_message(channel, method, (properties, body))` (replaced by `_send_message`) with
  `_body_max_length`, `_adapter_emit_data(data)`, `bytes_sent` and `frames_sent`.
- the connection's transport (`_AsyncTransportBase`, reached as `impl._transport`):
  `_MAX_RECV_BYTES` and `_MAX_CONSUME_BYTES` (how much one `recv` and one ioloop turn take
  in), and for `_send_now` `_sock`, `_tx_buffers`, `_state`, `_STATE_ACTIVE` and `write`.
- `pika.frame.Body`, `decode_frame`, `Method(...).marshal()`, `Header(...).marshal()` and
  the wire layout of a frame (type, channel, size, payload, `FRAME_END`).

On any other pika version, or when one of these is missing, pika's own frame code stays (only
slower) and `FramePatch` says so once. tests/unit/test_pika_frames.py pins the installed pika
to `SUPPORTED` and checks the patch's frames byte for byte against pika's own.
"""

from __future__ import annotations

import functools
import logging
import ssl
import struct
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
import pika.frame
import pika.spec

_log = logging.getLogger("splitmq.broker")

# The pika versions whose private frame code the patch was written against (see above); a new
# pika is added once its code has been compared again and tests/unit/test_pika_frames.py passes.
SUPPORTED = frozenset({"1.3.2", "1.4.0", "1.4.1", "1.4.2", "1.4.4"})
# Bytes one `recv` may take in (pika's default: 4 KiB).
RECV_BYTES = 1 << 20

_FRAME_HEAD = struct.Struct(">BHL")  # type, channel, payload size; the payload and 0xCE follow
_FRAME_END = bytes([pika.spec.FRAME_END])
_PIKA_HOOKS = ("_on_data_available", "_send_message", "_process_frame", "_adapter_emit_data")
_TRANSPORT_STATE = ("_sock", "_tx_buffers", "_state", "_STATE_ACTIVE", "write")


class FramePatch:
    """`tune_frames` for each new connection of one broker handle. On a pika not in
    `SUPPORTED`, or one whose internals differ, pika's own frame code stays and one line,
    the first time, says so."""

    def __init__(self, version: str = pika.__version__) -> None:
        self._version = version
        self._told = False

    def apply(self, connection: Any) -> bool:
        """Whether `connection` now reads and writes its frames through the patch."""
        if tune_frames(connection, self._version):
            return True
        if not self._told:
            self._told = True
            why = "not one" if self._version not in SUPPORTED else "one, but its internals differ"
            _log.info(
                "pika %s is %s of the versions broker.pika_frames was written for (%s): "
                "keeping pika's own frame reader and writer (the same messages, more copies)",
                self._version,
                why,
                ", ".join(sorted(SUPPORTED)),
            )
        return False


def tune_frames(connection: Any, version: str = pika.__version__) -> bool:
    """Give an open pika connection the frame reader and writer of this module; False, with
    the connection left as pika made it, on a pika `version` not in `SUPPORTED` or whose
    internals differ from what this expects."""
    impl: Any = getattr(connection, "_impl", None)
    transport: Any = getattr(impl, "_transport", None)
    if not (
        version in SUPPORTED
        and isinstance(getattr(transport, "_MAX_RECV_BYTES", None), int)
        and isinstance(getattr(impl, "_frame_buffer", None), bytes)
        and isinstance(getattr(impl, "_body_max_length", None), int)
        and all(callable(getattr(impl, name, None)) for name in _PIKA_HOOKS)
    ):
        return False
    reader = _FrameReader(impl)
    impl._on_data_available = reader.feed
    impl._send_message = functools.partial(_send_message, impl)
    transport._MAX_RECV_BYTES = RECV_BYTES
    transport._MAX_CONSUME_BYTES = max(RECV_BYTES, transport._MAX_CONSUME_BYTES)
    plain = not isinstance(getattr(transport, "_sock", None), ssl.SSLSocket)
    if plain and all(hasattr(transport, name) for name in _TRANSPORT_STATE):
        transport.write = functools.partial(_send_now, transport, transport.write)
    return True


def _send_now(transport: Any, buffered: Callable[[Any], None], data: bytes | memoryview) -> None:
    """pika's transport `write`, which only buffers and has the ioloop wait until the socket
    is writable, with a `send` first when nothing waits before `data`: a publish or an ack
    then goes out without a poll of the ioloop. What the socket does not take is buffered as
    pika would (also on an error, which pika's own send then meets and handles)."""
    if transport._tx_buffers or transport._state != transport._STATE_ACTIVE:
        buffered(data)
        return
    try:
        sent = transport._sock.send(data)
    except OSError:  # would block, or an error: pika's own send meets it again
        sent = 0
    if sent < len(data):
        buffered(memoryview(data)[sent:])


class _FrameReader:
    """pika's `Connection._on_data_available`, with frames parsed where they lie."""

    def __init__(self, impl: Any) -> None:
        self._impl = impl
        self._partial = bytearray(impl._frame_buffer)  # a frame cut by the end of a read
        impl._frame_buffer = b""

    def feed(self, data: bytes) -> None:
        """Process every whole frame of `data` (after completing the one a read cut last); keep
        the cut one's start. One call per read: the parse is inline."""
        start = 0
        partial = self._partial
        buffers: tuple[tuple[bytes, int], ...] = ((data, 0),)
        if partial:
            if len(partial) < _FRAME_HEAD.size:
                start = _FRAME_HEAD.size - len(partial)
                partial += data[:start]
                if len(partial) < _FRAME_HEAD.size:
                    return
            missing = _FRAME_HEAD.unpack_from(partial)[2] + 8 - len(partial)
            if missing > len(data) - start:
                partial += data[start:]
                return
            partial += data[start : start + missing]
            whole = bytes(partial)
            partial.clear()
            buffers = ((whole, 0), (data, start + missing))
        impl = self._impl
        for buffer, offset in buffers:
            view = memoryview(buffer)
            while len(buffer) - offset >= _FRAME_HEAD.size:
                kind, channel, size = _FRAME_HEAD.unpack_from(buffer, offset)
                end = offset + size + 8
                if end > len(buffer):
                    break
                if buffer[end - 1] != pika.spec.FRAME_END:
                    raise pika.exceptions.InvalidFrameError("Invalid FRAME_END marker")
                if kind == pika.spec.FRAME_BODY:
                    value: Any = pika.frame.Body(channel, view[offset + 7 : end - 1])
                else:
                    value = pika.frame.decode_frame(buffer[offset:end])[1]
                impl.bytes_received += end - offset  # pika's heartbeat checker watches it
                offset = end
                impl._process_frame(value)
            partial += view[offset:]  # nothing of `whole`: it is one whole frame


def _send_message(impl: Any, channel: int, method: Any, content: tuple[Any, bytes]) -> None:
    """pika's `Connection._send_message` (method, header and body frames), in one buffer."""
    properties, body = content
    pieces: list[bytes | memoryview] = [
        pika.frame.Method(channel, method).marshal(),
        pika.frame.Header(channel, len(body), properties).marshal(),
    ]
    limit = impl._body_max_length
    starts = range(0, len(body), limit)
    with memoryview(body) as view:
        for start in starts:
            chunk = view[start : start + limit]
            head = _FRAME_HEAD.pack(pika.spec.FRAME_BODY, channel, len(chunk))
            pieces += (head, chunk, _FRAME_END)
        data = b"".join(pieces)
    impl.bytes_sent += len(data)
    impl.frames_sent += 2 + len(starts)
    impl._adapter_emit_data(memoryview(data))  # a partial send re-queues a view, not a copy
