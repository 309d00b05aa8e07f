"""An open training recipe against plain SGD: LeNet-5 on CIFAR-10 through `splitmq up`.

    SPLITMQ_DATA_DIR=../shared/data python -m benchmarks.recipe_cifar \
        [--seeds 0 1] [--rounds 20] [--steps 60] [--json PATH] [--write-docs]

Each arm is the same job (SFL-V2, LeNet-5 cut after its first block, 4 clients on an iid split of
the full CIFAR-10 training set, `--rounds` rounds of `--steps` local steps of batch 32 per
client, evaluated on the whole 10,000-image test set after every round) run as local processes
over the real RabbitMQ and Redis (`splitmq up`); only the training recipe differs:

- `sgd`: plain SGD (lr 0.01, no momentum, no weight decay), cross-entropy, no augmentation;
- `sgd_momentum`: SGD with momentum 0.9 (lr 0.01): the stronger classical baseline;
- `recipe`: AdamW (lr 1e-3, weight decay 5e-4) on both sides, a cosine schedule stepped per
  round down to the last round, cross-entropy with label smoothing 0.1, and random crop (padding
  4) plus horizontal flip on the clients.

The budget is the same for every arm: rounds x steps x batch samples per client, i.e. the same
number of optimizer steps and of samples seen. Figures are the final round's test accuracy, mean
± std over the seeds (`job.seed`: initial model, partition, data order, augmentation draws).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, machine_line, write_section

ARMS: Mapping[str, str] = {
    "sgd": """
[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.01
momentum = 0.0
max_steps_per_round = {steps}
""",
    "sgd_momentum": """
[algorithm]
name = "sfl_v2"
batch_size = 32
lr = 0.01
momentum = 0.9
max_steps_per_round = {steps}
""",
    "recipe": """
[algorithm]
name = "sfl_v2"
batch_size = 32
max_steps_per_round = {steps}

[optimizer]
name = "adamw"
lr = 0.001
weight_decay = 0.0005

[schedule]
name = "cosineannealinglr"
every = "round"
T_max = {rounds}

[loss]
name = "cross_entropy"
label_smoothing = 0.1

[data.augment]
crop_padding = 4
horizontal_flip = true
""",
}

COMMON = """
[broker]
kind = "rabbitmq"
amqp_url = "amqp://guest:guest@127.0.0.1:5672/%2F"

[store]
kind = "redis"
redis_url = "redis://127.0.0.1:6379/0"

[job]
name = "{job}"
seed = {seed}
rounds = {rounds}

[model]
name = "lenet5"
cut = "block1"

[data]
dataset = "cifar10"
partition = "iid"

[clients]
count = 4
min_to_start = 4

[workers]
count = 1

[report]
plots = false
"""


def job_toml(arm: str, seed: int, rounds: int, steps: int) -> str:
    job = f"bench-recipe-{arm.replace('_', '-')}-{seed}"
    return COMMON.format(job=job, seed=seed, rounds=rounds) + ARMS[arm].format(
        steps=steps, rounds=rounds
    )


def run_arm(arm: str, seed: int, rounds: int, steps: int, work: Path) -> dict[str, Any]:
    """One `splitmq up` of `arm`; its per-round test accuracy and wall time."""
    config = work / f"{arm}-{seed}.toml"
    config.write_text(job_toml(arm, seed, rounds, steps))
    runs = work / f"runs-{arm}-{seed}"
    argv = [sys.executable, "-m", "services.cli.main", "up", str(config), "--report-dir", str(runs)]
    log = work / f"{arm}-{seed}.log"
    start = time.monotonic()
    with log.open("w") as out:
        code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT)
    wall = time.monotonic() - start
    if code != 0:
        raise RuntimeError(f"{arm} seed {seed}: splitmq up exited {code}; see {log}")
    (metrics,) = runs.glob("*/metrics.json")
    records = json.loads(metrics.read_text())["records"]
    accuracy = [float(r["global_accuracy"]) for r in records]
    print(f"{arm} seed {seed}: final accuracy {accuracy[-1]:.4f} in {wall:.0f} s", flush=True)
    return {"arm": arm, "seed": seed, "accuracy": accuracy, "wall_s": wall}


def mean_std(values: Sequence[float]) -> str:
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.mean(values):.1f} ± {100 * std:.1f} %"


def report(results: Sequence[Mapping[str, Any]], args: argparse.Namespace, load: str) -> str:
    lines = [
        "## Training recipe: AdamW + cosine + label smoothing + crop/flip vs SGD (issue 17)",
        "",
        f"Command: `SPLITMQ_DATA_DIR=../shared/data {command_line('benchmarks.recipe_cifar')}`",
        "",
        f"Machine: {machine_line()}; load average before/after: {load}.",
        "",
        f"LeNet-5 on CIFAR-10 (full training set, iid over 4 clients), SFL-V2 cut after block1, "
        f"through `splitmq up` (RabbitMQ + Redis), {args.rounds} rounds x {args.steps} local "
        "steps of batch 32 per client: the same budget for every arm (steps and samples). "
        f"Final test accuracy (10,000 images), mean ± std over seeds {args.seeds}:",
        "",
        "| arm | recipe | final accuracy | best round's accuracy | wall per run |",
        "|---|---|---|---|---|",
    ]
    described = {
        "sgd": "SGD lr 0.01, no momentum; cross-entropy; no augmentation",
        "sgd_momentum": "SGD lr 0.01, momentum 0.9; cross-entropy; no augmentation",
        "recipe": "AdamW lr 1e-3, wd 5e-4, cosine per round; label smoothing 0.1; crop 4 + flip",
    }
    for arm in args.arms:
        mine = [r for r in results if r["arm"] == arm]
        finals = [r["accuracy"][-1] for r in mine]
        bests = [max(r["accuracy"]) for r in mine]
        wall = statistics.median(r["wall_s"] for r in mine)
        lines.append(
            f"| {arm} | {described[arm]} | {mean_std(finals)} | {mean_std(bests)} | {wall:.0f} s |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    if not os.environ.get("SPLITMQ_DATA_DIR"):
        parser.error("set SPLITMQ_DATA_DIR to the folder holding cifar10 (.npz)")
    before = os.getloadavg()[0]
    results = []
    with tempfile.TemporaryDirectory(prefix="recipe-cifar-") as tmp:
        for seed in args.seeds:
            for arm in args.arms:  # interleaved: a change of load hits every arm alike
                results.append(run_arm(arm, seed, args.rounds, args.steps, Path(tmp)))
    load = f"{before:.2f} / {os.getloadavg()[0]:.2f}"
    if args.json:
        args.json.write_text(json.dumps({"results": results, "load": load}, indent=2))
    text = report(results, args, load)
    print(text)
    if args.write_docs:
        write_section("recipe_cifar", text)


if __name__ == "__main__":
    main()
