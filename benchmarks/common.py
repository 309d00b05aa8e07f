"""Small helpers shared by the benchmark scripts: summaries, the machine line, the docs file.

Each script owns one section of `docs/benchmarks.md`, delimited by ``<!-- name -->`` and
``<!-- /name -->`` markers, and rewrites only that section, so scripts never clobber each other.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
DOCS_HEADER = (
    "# Benchmarks\n\n"
    "Measured numbers, each section with the command that produced it and the machine it ran on.\n"
    "Sections are rewritten by their scripts (`--write-docs`); edit the scripts, not the numbers.\n"
)


@dataclass(frozen=True)
class Summary:
    """Median and 90th percentile of a set of timings, in seconds."""

    median: float
    p90: float
    count: int


def percentile(samples: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0..100) with linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("percentile of no samples")
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarise(samples: Sequence[float]) -> Summary:
    return Summary(statistics.median(samples), percentile(samples, 90), len(samples))


def machine_line(*extras: str) -> str:
    """One line naming the host: OS, CPU, core count, Python, plus whatever the caller adds."""
    parts = [
        platform.platform(),
        platform.processor() or platform.machine(),
        f"{os.cpu_count()} CPUs",
        f"python {platform.python_version()}",
        *extras,
    ]
    return ", ".join(parts)


def process_cpu_seconds(pid: int) -> float:
    """CPU time used so far by all live threads of process `pid` (Linux), nanosecond-grained.

    /proc/<pid>/stat counts in clock ticks (10 ms), too coarse for millisecond round trips;
    each thread's schedstat has its on-CPU time in nanoseconds.
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended while we looked
    return total / 1e9


def minor_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (Linux): each is a first touch of fresh memory."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # Fields after the parenthesised command name, which may itself hold spaces.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[7])  # minflt is field 10 of stat(5); this list starts at field 3


def command_line(module: str) -> str:
    """How this run was started, as a command someone can paste."""
    return shlex.join(["python", "-m", module, *sys.argv[1:]])


def write_section(name: str, text: str, path: Path = DOCS_PATH) -> None:
    """Replace (or append) the section `name` of the benchmarks doc with `text`."""
    start, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{start}\n{text.strip()}\n{end}\n"
    current = path.read_text() if path.exists() else DOCS_HEADER
    head, found, rest = current.partition(start)
    if found:
        _, closed, tail = rest.partition(end)
        if not closed:
            raise ValueError(f"{path}: {start} has no closing {end}")
        tail = tail.lstrip("\n")
        updated = head + block + ("\n" + tail if tail else "")
    else:
        updated = current.rstrip("\n") + "\n\n" + block
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(updated)


def cnn5_sample_sections(
    redis_url: str, job: str, seed: int, rounds: int, store_lines: str = ""
) -> str:
    """The `[store]`, `[job]`, `[model]` and `[data]` TOML sections the service benchmarks
    share: cnn5 cut after block1 on the shipped Fashion-MNIST sample, weights in Redis
    (`store_lines`: more of the store's settings, e.g. its Sentinels)."""
    return f"""
[store]
kind = "redis"
redis_url = "{redis_url}"
{store_lines}

[job]
name = "{job}"
seed = {seed}
rounds = {rounds}

[model]
name = "cnn5"
cut = "block1"

[data]
dataset = "fashion_mnist_sample"
partition = "iid"
"""
