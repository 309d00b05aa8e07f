"""What client-side augmentation costs a 64-image CIFAR-10 batch; run by hand.

    python -m benchmarks.augment_cost [--repeats 30] [--batches 50] [--threads 1]

Times, per batch of 64 normalised 3x32x32 images (random values: the cost does not depend on
them): making the batch as a client does (`index_select` from the dataset tensor), the same
plus each augmentation (`services.data.augment`, with its per-batch seeded generator), and a
LeNet-5 SGD step (forward, backward, step) for scale. Variants are interleaved repeat by
repeat, so a change of machine load hits them all alike; prints the median and minimum
milliseconds per batch over the repeats, and the load average before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from torch.nn import functional as F

from benchmarks.common import machine_line
from models.registry import build_model
from services.data.augment import Augmenter, batch_generator
from services.data.registry import Augmentation, get_spec

BATCH = 64
DATASET = 50_000


def variants(x: torch.Tensor, y: torch.Tensor, batches: int) -> dict[str, Callable[[int], object]]:
    info = get_spec("cifar10").info
    augmenters = {
        "flip": Augmenter.for_data(Augmentation(horizontal_flip=True), info),
        "crop (padding 4)": Augmenter.for_data(Augmentation(crop_padding=4), info),
        "crop + flip": Augmenter.for_data(Augmentation(4, True), info),
    }
    starts = torch.randint(0, DATASET, (batches, BATCH), generator=torch.Generator().manual_seed(0))

    def plain(i: int) -> torch.Tensor:
        return x.index_select(0, starts[i])

    def augmented(augmenter: Augmenter) -> Callable[[int], torch.Tensor]:
        def run(i: int) -> torch.Tensor:
            draws = batch_generator(seed=0, client=0, epoch=0, batch=i)
            return augmenter(x.index_select(0, starts[i]), draws)

        return run

    model = build_model("lenet5", num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(i: int) -> None:
        batch = plain(i)
        optimizer.zero_grad()
        F.cross_entropy(model(batch), y[starts[i]]).backward()
        optimizer.step()

    return {
        "batch only": plain,
        **{name: augmented(a) for name, a in augmenters.items()},
        "LeNet-5 SGD step": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(DATASET, 3, 32, 32, generator=generator)
    y = torch.randint(0, 10, (DATASET,), generator=generator)
    timed = variants(x, y, args.batches)
    load_before = os.getloadavg()[0]
    samples: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.repeats):
        for name, run in timed.items():
            started = time.perf_counter()
            for i in range(args.batches):
                run(i)
            samples[name].append((time.perf_counter() - started) / args.batches * 1e3)
    print(machine_line(f"torch {torch.__version__}", f"{args.threads} torch thread(s)"))
    print(f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after")
    print("| variant | median ms/batch | min ms/batch |")
    print("|---|---:|---:|")
    for name, values in samples.items():
        print(f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} |")


if __name__ == "__main__":
    main()
