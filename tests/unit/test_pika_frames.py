"""The pika frame patch (`broker.pika_frames`), pinned to the pika versions it was written for.

Without a server: a pika `Connection` with no socket stands in for a connection's internals,
so the patch's frames can be compared byte for byte with pika's own, both ways. A pika
upgrade fails `test_the_installed_pika_is_one_the_patch_was_written_for` until its private
code has been compared again and its version added to `SUPPORTED`.
"""

from __future__ import annotations

import logging
import re
import socket
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pika
import pika.adapters.utils.io_services_utils as pika_io
import pika.connection
import pika.frame
import pika.spec
import pytest

from broker.pika_frames import RECV_BYTES, SUPPORTED, FramePatch, tune_frames

_ROOT = Path(__file__).resolve().parents[2]
_FRAME_MAX = 4096  # pika's smallest frame size: a body frame carries 4088 bytes
_UNSUPPORTED = "1.2.1"


class _Wire(pika.connection.Connection):  # type: ignore[misc]
    """A pika connection without a socket: what it writes goes to `sent`, and each frame it
    reads is kept, marshalled again, in `read`."""

    def __init__(self) -> None:
        params = pika.ConnectionParameters(frame_max=_FRAME_MAX)
        super().__init__(params, internal_connection_workflow=False)
        self._body_max_length = self._get_body_frame_max_length()  # as pika's Connection.Tune
        self._transport = SimpleNamespace(
            _MAX_RECV_BYTES=pika_io._AsyncTransportBase._MAX_RECV_BYTES,
            _MAX_CONSUME_BYTES=pika_io._AsyncTransportBase._MAX_CONSUME_BYTES,
        )
        self.sent = bytearray()
        self.read: list[bytes] = []

    def _process_frame(self, frame_value: Any) -> None:
        self.read.append(frame_value.marshal())

    def _adapter_emit_data(self, data: bytes) -> None:
        self.sent += data

    def _adapter_call_later(self, delay: float, callback: Any) -> Any:
        raise AssertionError("no timers here")

    def _adapter_remove_timeout(self, timeout_id: Any) -> None:
        raise AssertionError("no timers here")

    def _adapter_add_callback_threadsafe(self, callback: Any) -> None:
        raise AssertionError("no threads here")

    def _adapter_connect_stream(self) -> None:
        raise AssertionError("no socket here")

    def _adapter_disconnect_stream(self) -> None:
        raise AssertionError("no socket here")


def _tuned() -> _Wire:
    wire = _Wire()
    assert tune_frames(SimpleNamespace(_impl=wire))
    return wire


def _publish(wire: _Wire, body: bytes, channel: int = 3) -> None:
    method = pika.spec.Basic.Publish(exchange="splitmq.x", routing_key="job.k", mandatory=True)
    properties = pika.BasicProperties(delivery_mode=2, headers={"seq": 7}, message_id="m-1")
    wire._send_message(channel, method, (properties, body))


_BODY = _FRAME_MAX - 8
_BODIES = {
    "empty": b"",
    "small": b"smashed",
    "one full frame": bytes(range(256)) * (_BODY // 256) + bytes(_BODY % 256),
    "one byte over": b"\x01" * (_BODY + 1),
    "multi-frame": bytes(range(251)) * 50 + b"tail",
}


def test_the_installed_pika_is_one_the_patch_was_written_for() -> None:
    assert pika.__version__ in SUPPORTED, (
        f"pika {pika.__version__}: compare its private frame code with broker/pika_frames.py's "
        "docstring, then add the version to SUPPORTED"
    )


def test_the_lowest_pika_the_project_allows_is_supported() -> None:
    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    bounds = [re.fullmatch(r"pika>=([\d.]+)", dep) for dep in project["dependencies"]]
    lowest = [found.group(1) for found in bounds if found]
    assert lowest and lowest[0] in SUPPORTED


def test_the_private_attributes_the_patch_touches_are_on_this_pika() -> None:
    wire = _Wire()
    for name in ("_on_data_available", "_send_message", "_process_frame", "_adapter_emit_data"):
        assert callable(getattr(pika.connection.Connection, name, None)), name
    assert isinstance(wire._frame_buffer, bytes)
    for name in ("bytes_received", "bytes_sent", "frames_sent"):
        assert getattr(wire, name) == 0, name
    assert isinstance(pika_io._AsyncTransportBase._MAX_RECV_BYTES, int)
    assert isinstance(pika_io._AsyncTransportBase._MAX_CONSUME_BYTES, int)
    assert callable(pika.frame.decode_frame)
    assert (pika.spec.FRAME_BODY, pika.spec.FRAME_END) == (3, 0xCE)
    assert pika.frame.Body(1, b"x").marshal() == b"\x03\x00\x01\x00\x00\x00\x01x\xce"
    left, right = socket.socketpair()
    with left, right:
        nbio = SimpleNamespace(set_reader=lambda fd, on_readable: None)
        transport = pika_io._AsyncPlaintextTransport(left, None, nbio)
        assert transport._sock is left
        assert not transport._tx_buffers
        assert transport._state == transport._STATE_ACTIVE
        assert callable(transport.write)


@pytest.mark.parametrize("name", list(_BODIES))
def test_published_frames_are_pikas_own_byte_for_byte(name: str) -> None:
    plain, tuned = _Wire(), _tuned()
    _publish(plain, _BODIES[name])
    _publish(tuned, _BODIES[name])
    assert bytes(tuned.sent) == bytes(plain.sent)
    assert (tuned.bytes_sent, tuned.frames_sent) == (plain.bytes_sent, plain.frames_sent)


@pytest.mark.parametrize("cut", [1, 5, 7, 8, 100, 4096, 1 << 20])
def test_frames_read_are_pikas_own_wherever_the_reads_cut(cut: int) -> None:
    source = _Wire()
    for body in _BODIES.values():
        _publish(source, body)
    data = bytes(source.sent)
    plain, tuned = _Wire(), _tuned()
    for start in range(0, len(data), cut):
        plain._on_data_available(data[start : start + cut])
        tuned._on_data_available(data[start : start + cut])
    assert tuned.read == plain.read
    assert b"".join(tuned.read) == data
    assert tuned.bytes_received == plain.bytes_received == len(data)


def test_a_supported_pika_gets_the_patch() -> None:
    wire = _Wire()
    assert FramePatch(pika.__version__).apply(SimpleNamespace(_impl=wire))
    assert "_on_data_available" in vars(wire) and "_send_message" in vars(wire)
    assert wire._transport._MAX_RECV_BYTES == RECV_BYTES


def test_another_pika_is_left_alone_and_told_once(caplog: pytest.LogCaptureFixture) -> None:
    patch = FramePatch(_UNSUPPORTED)
    wires = [_Wire(), _Wire()]
    with caplog.at_level(logging.INFO, logger="splitmq.broker"):
        assert not any(patch.apply(SimpleNamespace(_impl=wire)) for wire in wires)
    for wire in wires:
        assert "_on_data_available" not in vars(wire) and "_send_message" not in vars(wire)
        assert wire._transport._MAX_RECV_BYTES == pika_io._AsyncTransportBase._MAX_RECV_BYTES
    told = [r.getMessage() for r in caplog.records if r.name == "splitmq.broker"]
    assert len(told) == 1 and _UNSUPPORTED in told[0]
    plain = _Wire()
    _publish(wires[0], _BODIES["multi-frame"])
    _publish(plain, _BODIES["multi-frame"])
    assert wires[0].sent == plain.sent  # pika's own frames, through pika's own code


def test_unknown_objects_are_left_alone() -> None:
    class Stranger:
        pass

    assert not tune_frames(Stranger())
    assert not tune_frames(SimpleNamespace(_impl=Stranger()))


def test_a_plain_socket_write_goes_out_at_once() -> None:
    left, right = socket.socketpair()
    with left, right:
        left.setblocking(False)  # as pika's sockets are
        nbio = SimpleNamespace(set_reader=lambda fd, on_readable: None)
        transport = pika_io._AsyncPlaintextTransport(left, None, nbio)
        wire = _Wire()
        wire._transport = transport
        assert tune_frames(SimpleNamespace(_impl=wire))
        transport.write(b"frame")  # pika's own only buffers it for the ioloop
        assert right.recv(16) == b"frame"
        assert not transport._tx_buffers
