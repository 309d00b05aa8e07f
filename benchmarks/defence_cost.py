"""What the defences on smashed data cost a client step; run by hand.

    python -m benchmarks.defence_cost [--repeats 15] [--steps 20] [--threads 1] [--json PATH]
    python -m benchmarks.defence_cost --quick

An SFL-V2 client round (`SFL.client_round`, the code a real client runs) of cnn5 cut after
block1 at batch 32, in-process: the channel hands back a fixed dL/dz at once, so what is timed
is the client's own step (forward, the defences, backward, SGD step) and nothing of the
broker's or the server's. Each variant runs `--steps` steps a round, `--repeats` rounds,
interleaved with the others so that a change of machine load hits them all alike; the figure
is the median per-step time over the rounds, and its ratio to the undefended step's. The load
average before and after is printed with the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import machine_line
from models.registry import build_model
from services.algorithms.base import ClientContext, Hyper, LocalRound, StrategyBase, Tally
from services.algorithms.registry import build_strategy

CUT = "block1"
BATCH = 32

# The variants timed: the `privacy.` parameters a client would be sent.
VARIANTS: Mapping[str, Mapping[str, object]] = {
    "none": {},
    "noise": {"privacy.noise_scale": 0.1},
    "clip": {"privacy.clip_norm": 10.0},
    "clip+noise": {"privacy.clip_norm": 10.0, "privacy.noise_scale": 0.1},
    "nopeek": {"privacy.nopeek_weight": 0.1},
    "all": {
        "privacy.clip_norm": 10.0,
        "privacy.noise_scale": 0.1,
        "privacy.nopeek_weight": 0.1,
    },
}


class FixedGradient:
    """A channel whose server answers at once with the same dL/dz."""

    def __init__(self, grad: torch.Tensor) -> None:
        self.grad = grad

    @property
    def tally(self) -> Tally:
        raise AssertionError("not used")

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        return self.grad

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("not used")


@dataclass(frozen=True)
class Cost:
    variant: str
    median_ms: float  # per step
    min_ms: float
    ratio: float  # median over the undefended median


def round_seconds(strategy: StrategyBase, steps: int, round_index: int) -> float:
    """One client round of `steps` steps: its wall time."""
    torch.manual_seed(0)
    model = build_model("cnn5")
    g = torch.Generator().manual_seed(round_index)
    batches = [
        (torch.randn(BATCH, 1, 28, 28, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
        for _ in range(steps)
    ]
    with torch.no_grad():
        z = model.client_blocks(CUT)(batches[0][0])
    channel = FixedGradient(torch.randn(z.shape, generator=g) * 1e-3)
    context = ClientContext("bench", round_index)
    r = LocalRound(model, CUT, batches, steps, channel, Hyper(lr=0.01), context)
    started = time.perf_counter()
    strategy.client_round(r)
    return time.perf_counter() - started


def measure(repeats: int, steps: int) -> list[Cost]:
    strategies = {name: build_strategy("sfl_v2", dict(p)) for name, p in VARIANTS.items()}
    per_step: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for strategy in strategies.values():  # warm-up: allocator, kernels
        round_seconds(strategy, 2, 0)
    for repeat in range(repeats):
        for name, strategy in strategies.items():
            per_step[name].append(round_seconds(strategy, steps, repeat + 1) / steps)
    base = statistics.median(per_step["none"])
    return [
        Cost(name, 1e3 * statistics.median(t), 1e3 * min(t), statistics.median(t) / base)
        for name, t in per_step.items()
    ]


def main(argv: Sequence[str] | None = None) -> list[Cost]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a device: 1)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--quick", action="store_true", help="2 repeats of 3 steps (a test)")
    args = parser.parse_args(argv)
    repeats, steps = (2, 3) if args.quick else (args.repeats, args.steps)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    costs = measure(repeats, steps)
    load_after = os.getloadavg()[0]
    print(machine_line(f"torch {torch.__version__}", f"{args.threads} torch thread(s)"))
    print(f"load average {load_before:.1f} before, {load_after:.1f} after")
    print(f"cnn5 cut {CUT}, batch {BATCH}: {repeats} rounds of {steps} client steps per variant")
    print(f"{'variant':<12} {'median ms/step':>14} {'min':>8} {'x none':>7}")
    for c in costs:
        print(f"{c.variant:<12} {c.median_ms:>14.2f} {c.min_ms:>8.2f} {c.ratio:>7.2f}")
    if args.json is not None:
        doc = {
            "machine": machine_line(f"torch {torch.__version__}"),
            "threads": args.threads,
            "load": [load_before, load_after],
            "repeats": repeats,
            "steps": steps,
            "variants": {name: dict(p) for name, p in VARIANTS.items()},
            "costs": [asdict(c) for c in costs],
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return costs


if __name__ == "__main__":
    main()
