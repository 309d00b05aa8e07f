"""What recording the schedule costs a worker per batch, against a cnn5 server step; by hand.

    python -m benchmarks.schedule_cost [--repeats 9] [--steps 200] [--json PATH] [--write-docs]

The worker's own recording code, timed alone and interleaved with the step it rides on
(issue 36's target: at most 2% of a cnn5 step): per batch an `Applied` entry buffered; per
checkpoint (`workers.checkpoint_every_steps`, default 50) the entries encoded and written in
one store call, with a `Checkpointed` entry and the digest of the server-side weights. A
deterministic job writes that way; a free-running one writes each step's entry at once, one
store call a step. Both on the in-memory store and on the Redis at SPLITMQ_REDIS_URL (default
127.0.0.1:6379). The step: cnn5 cut after block1, batch 32, SGD with momentum, forward and
backward of the server blocks (what `SFL` runs per batch), one torch thread. Medians over
`--repeats` rounds; the machine and its load are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.common import command_line, machine_line, write_section
from broker.memory_store import InMemoryWeightStore
from broker.redis_store import RedisWeightStore
from broker.store import ScheduleStore
from models.registry import build_model
from services.common.schedule import Applied, Checkpointed, ScheduleLog, state_digest

CUT = "block1"
BATCH = 32
EVERY = 50  # workers.checkpoint_every_steps' default


def server_step() -> tuple[Callable[[], None], torch.nn.Module]:
    model = build_model("cnn5", num_classes=10)
    server = model.server_blocks(CUT)
    head_in = model.cut_shape(CUT)
    z = torch.randn(BATCH, *head_in, requires_grad=True)
    y = torch.randint(0, 10, (BATCH,))
    opt = torch.optim.SGD(server.parameters(), lr=0.05, momentum=0.9)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(server(z), y)
        loss.backward()
        opt.step()

    return step, server


def recorder(
    store: ScheduleStore, job: str, server: torch.nn.Module, *, per_step: bool
) -> Callable[[int], None]:
    """The worker's recording for batch `n`: `per_step` writes at once (free-running), else
    every `EVERY` batches with a checkpoint entry (deterministic)."""
    log = ScheduleLog(store, job, "shard-0")

    def record(n: int) -> None:
        log.pending.append(Applied(0, "client-3", n // 40, n % 40, 7, n, n, "worker-0"))
        if per_step:
            log.flush()
        if n % EVERY == 0:
            digest = state_digest(server.state_dict())
            log.add(Checkpointed(0, n, 7, digest, "worker-0"))
            log.flush()

    return record


def timed(fn: Callable[[int], None], steps: int) -> float:
    start = time.perf_counter()
    for n in range(1, steps + 1):
        fn(n)
    return (time.perf_counter() - start) / steps


def section(
    rows: dict[str, dict[str, float]], step_s: float, load: float, args: argparse.Namespace
) -> str:
    lines = [
        "## Schedule record: its cost per batch (issue 36)",
        "",
        f"`{command_line('benchmarks.schedule_cost')}` on {machine_line()}, load "
        f"{load:.2f} at the start; medians of {args.repeats} rounds of {args.steps} batches "
        "each, the variants interleaved. What a worker does to record the batches it applies "
        "(benchmarks/schedule_cost.py's docstring), against the cnn5 server step it rides on "
        f"({step_s * 1e3:.2f} ms at batch {BATCH}, one torch thread). Target: at most 2% of a "
        "step. *checkpoint*: a deterministic job's shard writes its entries with each "
        f"checkpoint (every {EVERY} steps by default); *each*: a free-running job's, before "
        'every step\'s replies (docs/reproducibility.md, "What a record costs").',
        "",
        "| store, written | µs per batch | of a cnn5 step |",
        "|---|---:|---:|",
    ]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['us_per_batch']:.1f} | {row['of_step']:.2%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-docs", action="store_true", help="docs/benchmarks.md section")
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    step, server = server_step()
    redis_url = os.environ.get("SPLITMQ_REDIS_URL", "redis://127.0.0.1:6379/0")
    memory, redis = InMemoryWeightStore(), RedisWeightStore(redis_url)
    stores: dict[str, ScheduleStore] = {"memory": memory, "redis": redis}
    job = f"bench-schedule-{uuid.uuid4().hex[:8]}"
    print(machine_line())
    samples: dict[str, list[float]] = {"step": []}
    variants = {
        f"{name} {mode}": recorder(store, f"{job}-{name}-{mode}", server, per_step=mode == "each")
        for name, store in stores.items()
        for mode in ("checkpoint", "each")
    }
    for _ in range(args.repeats):
        samples["step"].append(timed(lambda n: step(), args.steps))
        for name, fn in variants.items():
            samples.setdefault(name, []).append(timed(fn, args.steps))
    medians = {k: statistics.median(v) for k, v in samples.items()}
    step_s = medians["step"]
    print(f"cnn5 server step (batch {BATCH}, 1 thread): {step_s * 1e3:.3f} ms")
    rows = {}
    for name in variants:
        cost = medians[name]
        rows[name] = {"us_per_batch": cost * 1e6, "of_step": cost / step_s}
        print(f"  record, {name:<18} {cost * 1e6:8.1f} us/batch  {cost / step_s:6.2%} of a step")
    print(f"load after: {os.getloadavg()[0]:.2f}")
    for name, full in (("memory", memory), ("redis", redis)):
        for mode in ("checkpoint", "each"):
            full.delete_job(f"{job}-{name}-{mode}")
    redis.close()
    if args.write_docs:
        write_section("schedule-cost", section(rows, step_s, load_before, args))
    if args.json:
        doc = {"machine": machine_line(), "step_ms": step_s * 1e3, "record": rows}
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
