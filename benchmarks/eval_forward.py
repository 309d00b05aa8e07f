"""What evaluating the small CNNs costs, with `models.pooling` against torch's max-pool; run by
hand.

    python -m benchmarks.eval_forward [--repeats 7] [--images 2000]

LeNet-5 (3x32x32) and the 5-layer CNN (1x28x28), eval mode, no autograd, `--images` random
images in chunks of 512 (as the clients' local accuracy and the aggregator evaluate), one torch
thread. Each repeat runs both variants, alternating: the zoo's model, and a copy whose
`models.pooling.MaxPool2d` modules are swapped for `nn.MaxPool2d`. Prints the median and
minimum CPU seconds (`time.process_time`) per evaluation, whether the logits are identical, and
the load average before and after.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time

import torch
from torch import nn

from benchmarks.common import machine_line
from models.pooling import MaxPool2d
from models.registry import build_model

CHUNK = 512


def with_torchs_pooling(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    for parent in other.modules():
        for name, child in parent.named_children():
            if isinstance(child, MaxPool2d):
                setattr(parent, name, nn.MaxPool2d(child.kernel_size))
    return other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--images", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cases = {
        "lenet5": (build_model("lenet5", num_classes=10), (3, 32, 32)),
        "cnn5": (build_model("cnn5"), (1, 28, 28)),
    }
    load_before = os.getloadavg()[0]
    rows = []
    for name, (model, shape) in cases.items():
        variants = {"models.pooling": model.eval(), "nn.MaxPool2d": with_torchs_pooling(model)}
        x = torch.randn(args.images, *shape)
        seconds: dict[str, list[float]] = {v: [] for v in variants}
        logits: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for _ in range(args.repeats):
                for variant, net in variants.items():
                    started = time.process_time()
                    logits[variant] = torch.cat([net(c) for c in x.split(CHUNK)])
                    seconds[variant].append(time.process_time() - started)
        identical = torch.equal(logits["models.pooling"], logits["nn.MaxPool2d"])
        for variant, values in seconds.items():
            rows.append((name, variant, statistics.median(values), min(values), identical))
    print(machine_line(f"torch {torch.__version__}", "1 torch thread"))
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| model | pooling | median CPU s | min CPU s | logits identical |")
    print("|---|---|---:|---:|---|")
    for name, variant, median, least, identical in rows:
        print(f"| {name} | {variant} | {median:.3f} | {least:.3f} | {identical} |")


if __name__ == "__main__":
    main()
