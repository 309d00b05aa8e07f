"""Codec throughput against naive baselines; run by hand, not a test.

    python -m benchmarks.codec_bench [--reps 30] [--threads N]

Throughput is tensor payload bytes / median wall time (GB = 1e9 bytes). "finite check off"
rows patch the decoder's check out to show what it costs; production always runs it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from unittest import mock

import msgpack
import torch

import broker.codec
from broker.codec import decode, encode, encode_into
from broker.messages import SmashedBatch, new_message_id
from broker.tensors import all_finite

MiB = 2**20
SHAPES = {"1.5 MiB": (64, 24, 16, 16), "16 MiB": (64, 64, 32, 32)}


@dataclass(frozen=True)
class Row:
    case: str
    size: str
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def median_time(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def batch(shape: tuple[int, ...]) -> SmashedBatch:
    return SmashedBatch(
        job="bench",
        client="c0",
        message_id=new_message_id(),
        version=1,
        seq=1,
        shard=0,
        round=0,
        step=0,
        activations=torch.randn(shape),
        labels=torch.randint(0, 10, (shape[0],)),
    )


def measure(size: str, shape: tuple[int, ...], reps: int) -> list[Row]:
    message = batch(shape)
    tensor = message.activations
    nbytes = tensor.nbytes
    body = encode(message)
    buffer = bytearray()
    raw = tensor.numpy().tobytes()

    def round_trip() -> None:
        decode(encode(message))

    def round_trip_into() -> None:
        view = encode_into(message, buffer)
        decode(view)
        view.release()

    def decode_unchecked() -> None:
        with mock.patch.object(broker.codec, "all_finite", lambda _t: True):
            decode(body)

    def into() -> None:
        encode_into(message, buffer).release()

    cases: list[tuple[str, Callable[[], object]]] = [
        ("**encode + decode** (bytes)", round_trip),
        ("**encode_into + decode** (reused buffer)", round_trip_into),
        ("encode -> bytes", lambda: encode(message)),
        ("encode_into reused buffer", into),
        ("encode_into fresh bytearray", lambda: encode_into(message, bytearray()).release()),
        ("decode (finite check on)", lambda: decode(body)),
        ("decode (finite check off)", decode_unchecked),
        ("finite check alone: all_finite (aminmax)", lambda: all_finite(tensor)),
        ("finite check alt: isfinite(t).all()", lambda: bool(torch.isfinite(tensor).all())),
        ("baseline: tensor.numpy().tobytes()", lambda: tensor.numpy().tobytes()),
        ("baseline: msgpack.packb(bytes)+unpackb", lambda: msgpack.unpackb(msgpack.packb(raw))),
    ]
    return [Row(name, size, median_time(fn, reps), nbytes) for name, fn in cases]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for size, shape in SHAPES.items() for row in measure(size, shape, args.reps)]
    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__} with {torch.get_num_threads()} "
        f"threads, python {platform.python_version()}, median of {args.reps}, load average "
        f"{os.getloadavg()[0]:.2f} (machine shared)\n"
    )
    sizes = list(SHAPES)
    print("| case | " + " | ".join(f"{s} GB/s (ms)" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    for case in dict.fromkeys(row.case for row in rows):
        cells = [
            f"{r.gbps:.2f} ({r.seconds * 1e3:.2f})"
            for s in sizes
            for r in rows
            if r.case == case and r.size == s
        ]
        print(f"| {case} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
