"""What one Sub-FedAvg client round costs at the paper's setting; run by hand.

    python -m benchmarks.subfedavg_round [--repeats 5]

A LeNet-5 client with 500 training images (random 3x32x32 values: the cost does not depend on
them), E = 5 passes of batch 10 (250 steps), SGD lr 0.01 momentum 0.5, pruning 10% a round,
and a local test set of 2,000 images, as in `examples/experiments/subfedavg-paper.toml`. Two
cases: a pruning trial that is accepted (`acc_thresh = 0`) and one that is rejected
(`acc_thresh = 1`). After the round the client measures its model on the local test set, as
`services/client/runner.py` does, unless the algorithm reported it (`personal_accuracy`).
Prints, per case, how many times the local test set was evaluated and the median and minimum
CPU seconds (`time.process_time`) of the round and that measurement over the repeats (the
first, warm-up round is left out), and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import cast

import torch

from benchmarks.common import machine_line
from models.registry import build_model
from services.algorithms.base import ClientContext, Hyper, LocalRound, SmashedChannel
from services.algorithms.subfedavg import SubFedAvg, SubFedAvgSection

TRAIN, TEST, BATCH, EPOCHS = 500, 2000, 10, 5


class NoChannel:
    """The full-model scope never talks to a worker (nor uses the channel's other members)."""

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        raise AssertionError("no worker in a full-model round")

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("no worker in a full-model round")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(TRAIN, 3, 32, 32, generator=g), torch.randint(0, 10, (TRAIN,), generator=g)
    tx, ty = torch.randn(TEST, 3, 32, 32, generator=g), torch.randint(0, 10, (TEST,), generator=g)
    evaluations = 0

    def local_accuracy(model: torch.nn.Module) -> float:
        nonlocal evaluations
        evaluations += 1
        model.eval()
        with torch.no_grad():
            correct = sum(
                int((model(a).argmax(1) == b).sum())
                for a, b in zip(tx.split(512), ty.split(512), strict=True)
            )
        model.train()
        return correct / TEST

    hyper = Hyper(lr=0.01, momentum=0.5, local_epochs=EPOCHS)
    batches = [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, TRAIN, BATCH)] * EPOCHS
    channel = cast(SmashedChannel, NoChannel())
    load_before = os.getloadavg()[0]
    rows = []
    for case, threshold in (("trial accepted", 0.0), ("trial rejected", 1.0)):
        params = {"prune_percent": 0.1, "target": 0.5, "dist_thresh": 0.0}
        strategy = SubFedAvg(
            config=SubFedAvgSection.model_validate({**params, "acc_thresh": threshold})
        )
        seconds: list[float] = []
        for repeat in range(args.repeats + 1):
            torch.manual_seed(0)
            model = build_model("lenet5", num_classes=10)
            context = ClientContext("c1", 0, local_accuracy=local_accuracy)
            evaluations = 0
            started = time.process_time()
            result = strategy.client_round(
                LocalRound(model, "block1", iter(batches), len(batches), channel, hyper, context)
            )
            if "personal_accuracy" not in result.metrics:
                local_accuracy(model)
            if repeat:
                seconds.append(time.process_time() - started)
        rows.append((case, evaluations, statistics.median(seconds), min(seconds)))
    print(machine_line(f"torch {torch.__version__}", "1 torch thread"))
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| case | local-test evaluations per round | median CPU s | min CPU s |")
    print("|---|---:|---:|---:|")
    for case, count, median, least in rows:
        print(f"| {case} | {count} | {median:.2f} | {least:.2f} |")


if __name__ == "__main__":
    main()
