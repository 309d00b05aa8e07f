"""The worker's data plane between the wire and the replica's device.

A received body is decoded into zero-copy views of its bytes (`broker.codec`). On a CUDA
replica (`DevicePlane`) a batch's activations (a TailGradient's gradient) then go through a
pinned host buffer to the device, asynchronously on a copy stream of their own, and the step's
compute stream waits for that copy on the device, not the host. A reply's tensor comes back
through a pinned buffer, converted to its wire dtype on the device first (half the bytes for
bfloat16). Labels stay on the host: the shard's checks read them, and a step copies a few
hundred bytes.

`Inbox` hands the worker its deliveries decoded and staged; with `ahead`, it decodes (and
copies) the next delivery on a thread of its own while the worker steps on the current one, a
prefetch of one. The order of deliveries never changes, so the worker does exactly what it does
without it. A prefetched delivery of a queue the worker gives back (`forget`) is dropped: the
broker returns it with the queue's other unsettled deliveries.

On the CPU the same objects run: pinning and streams are skipped, the decode thread is not, so
tests compare the prefetch path against the plain one where CI runs.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
import torch

from broker.codec import decode
from broker.errors import DecodeError
from broker.messages import Message, SmashedBatch, TailGradient
from broker.tensors import host_array
from broker.transport import Broker, Delivery

Prefetch = Literal["auto", "on", "off"]


def prefetches(setting: Prefetch, device: torch.device) -> bool:
    """`workers.prefetch`: `auto` decodes ahead for a CUDA replica only. On a CPU replica the
    decode thread competes with the step for the same cores."""
    return setting == "on" or (setting == "auto" and device.type == "cuda")


@dataclass(frozen=True, slots=True)
class Staged:
    """A decoded message whose tensors may still be on their way to the device (`copied`
    records when they are there, on the plane's copy stream)."""

    message: Message
    copied: torch.cuda.Event | None = None


class DevicePlane:
    """Tensors between the wire and `device`; the identity for a CPU device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        # A side stream: the copy of the next batch overlaps the current step's kernels.
        self._copies = torch.cuda.Stream(device) if self._cuda else None

    def stage(self, message: Message) -> Staged:
        """Start `message`'s tensor on its way to the device (any thread)."""
        if self._copies is None:
            return Staged(message)
        if isinstance(message, SmashedBatch):
            tensor = message.activations
        elif isinstance(message, TailGradient):
            tensor = message.grad
        else:
            return Staged(message)
        with torch.cuda.device(self.device), torch.cuda.stream(self._copies):
            pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            # numpy's copy, not torch's: torch would start an OpenMP team on this thread too.
            np.copyto(host_array(pinned), host_array(tensor))
            moved = pinned.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._copies)
        if isinstance(message, SmashedBatch):
            return Staged(replace(message, activations=moved), copied)
        return Staged(replace(message, grad=moved), copied)

    def ready(self, staged: Staged) -> Message:
        """`staged`'s message, usable on the compute stream (call on the compute thread)."""
        message = staged.message
        if staged.copied is None or not isinstance(message, SmashedBatch | TailGradient):
            return message
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(staged.copied)
        tensor = message.activations if isinstance(message, SmashedBatch) else message.grad
        # Allocated on the copy stream, used on this one: the allocator must not reuse it
        # before this stream is done with it.
        tensor.record_stream(stream)
        return message

    def host(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host copy of `tensor` as `dtype`, for the wire."""
        tensor = tensor.detach()
        if not self._cuda or tensor.device.type != "cuda":
            return tensor.to(device="cpu", dtype=dtype).contiguous()
        wire = tensor.to(dtype=dtype).contiguous()  # converted where the values are
        out = torch.empty(wire.shape, dtype=dtype, pin_memory=True)
        out.copy_(wire, non_blocking=True)
        # The encoder reads `out` next: wait for this copy only, not for other streams.
        torch.cuda.current_stream(self.device).synchronize()
        return out


@dataclass(frozen=True, slots=True)
class Arrival:
    """A delivery and its message, or why its body was refused."""

    delivery: Delivery
    message: Message | None
    error: DecodeError | None = None


Decoded = Staged | DecodeError


@dataclass(eq=False)
class _Pending:
    delivery: Delivery
    decoded: concurrent.futures.Future[Decoded] | Decoded


class Inbox:
    """The worker's deliveries from `broker`, decoded and staged by `plane`; with `ahead`, the
    next one is decoded on a thread of its own while the caller works on the last one."""

    def __init__(
        self,
        broker: Broker,
        plane: DevicePlane,
        *,
        ahead: bool,
        decoder: Callable[[bytes], Message] | None = None,
    ) -> None:
        """`decoder`: `broker.codec.decode` unless given (tests wrap it)."""
        self._broker = broker
        self._plane = plane
        self._staging = plane.device.type == "cuda"  # else `DevicePlane.stage` is the identity
        self._decoder = decoder or decode
        self._pool = (
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="splitmq-decode")
            if ahead
            else None
        )
        self._next: _Pending | None = None

    def get(self, timeout: float) -> Arrival | None:
        """The next delivery (waiting at most `timeout` when none is decoded ahead)."""
        pending, self._next = self._next, None
        if pending is None:
            pending = self._take(timeout)
            if pending is None:
                return None
        if self._pool is not None:
            # Only what the broker holds already: the caller has work now.
            self._next = self._take(0.0)
        decoded = pending.decoded
        if isinstance(decoded, concurrent.futures.Future):
            decoded = decoded.result()
        if isinstance(decoded, DecodeError):
            return Arrival(pending.delivery, None, decoded)
        if decoded.copied is None:  # nothing on its way to a device (`DevicePlane.ready`)
            return Arrival(pending.delivery, decoded.message)
        return Arrival(pending.delivery, self._plane.ready(decoded))

    def forget(self, queue: str) -> None:
        """The caller gave `queue` back: its delivery decoded ahead went back with it."""
        if self._next is not None and self._next.delivery.queue == queue:
            self._next = None

    def close(self) -> None:
        self._next = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def _take(self, timeout: float) -> _Pending | None:
        delivery = self._broker.get(timeout)
        if delivery is None:
            return None
        if self._pool is None:
            return _Pending(delivery, self._decode(delivery.body))
        return _Pending(delivery, self._pool.submit(self._decode, delivery.body))

    def _decode(self, body: bytes) -> Decoded:
        try:
            message = self._decoder(body)
        except DecodeError as exc:
            return exc
        return self._plane.stage(message) if self._staging else Staged(message)
