"""The in-process SFL-V2 loop the MQ deployment is compared with; runs in a process of its own.

    python -m benchmarks.sfl_inprocess --model cnn5 --cut block1 --dataset fashion_mnist \
        --threads 1 2 --reps 3 --warm 8 --steps 80

One process, no broker: four clients' bodies (copies of the same initial model) and one server
side, stepping exactly as SFL-V2 does over the wire — client forward, the worker's server step
(`SFL.server_step`: forward, backward, optimizer step, dL/dz), client backward and step —
cycling over the four clients' batches in turn. Data, partition (IID over 4 clients), batch
size, optimizer and learning rate are the deployment's. Each repetition times `steps` steps
after `warm` untimed ones, at each thread count in turn; prints one JSON line per repetition.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.sfl_deploy import BATCH, CLIENTS
from models.parts import ServerModel
from services.algorithms.base import CohortBatch, Hyper
from services.algorithms.sfl import SFL
from services.client.data import JobData, client_batches
from services.config.loading import load_settings
from services.data.batches import Batch
from workers.model import job_model


class Loop:
    """The whole SFL-V2 job in one process."""

    def __init__(self, model: str, cut: str, dataset: str, data_dir: Path) -> None:
        settings = load_settings(
            None,
            {
                "SPLITMQ_MODEL__NAME": model,
                "SPLITMQ_MODEL__CUT": cut,
                "SPLITMQ_DATA__DATASET": dataset,
                "SPLITMQ_DATA__DIR": str(data_dir),
                "SPLITMQ_ALGORITHM__BATCH_SIZE": str(BATCH),
                "SPLITMQ_CLIENTS__COUNT": str(CLIENTS),
            },
        )
        net = job_model(settings)
        hyper = Hyper(lr=settings.algorithm.lr, momentum=settings.algorithm.momentum)
        self.strategy = SFL()
        self.server = ServerModel(copy.deepcopy(net), cut)
        self.server.train()
        self.server_opt = hyper.server_optimizer(self.server.parameters())
        self.bodies = []
        for _ in range(CLIENTS):
            body = copy.deepcopy(net).client_blocks(cut)
            body.train()
            self.bodies.append((body, hyper.client_optimizer(body.parameters())))
        data = JobData(settings)
        self.batches = [
            _forever(client_batches(data, k, batch_size=BATCH, seed=settings.job.seed))
            for k in range(CLIENTS)
        ]
        self.turn = 0

    def step(self) -> None:
        k = self.turn % CLIENTS
        self.turn += 1
        x, y = next(self.batches[k])
        body, optimizer = self.bodies[k]
        z = body(x)
        batch = CohortBatch(f"client-{k}", z.detach(), y, float(y.shape[0]))
        [(grad, _loss, _correct)] = self.strategy.server_step(
            self.server, self.server_opt, [batch]
        )
        optimizer.zero_grad(set_to_none=True)
        z.backward(grad.to(dtype=z.dtype))
        optimizer.step()

    def rate(self, warm: int, steps: int) -> tuple[float, float]:
        """Samples/s over `steps` timed steps, and CPU seconds per step."""
        for _ in range(warm):
            self.step()
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.step()
        wall = time.perf_counter() - started
        return steps * BATCH / wall, (time.process_time() - cpu) / steps


def _forever(batches: object) -> Iterator[Batch]:
    epoch = 0
    while True:
        yield from batches.epoch(epoch)  # type: ignore[attr-defined]
        epoch += 1


def main() -> None:
    parser = argparse.ArgumentParser(description="in-process SFL-V2 throughput")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cut", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument("--data-dir", type=Path, default=Path(os.environ.get("SPLITMQ_DATA_DIR", "")))
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    args = parser.parse_args()
    loop = Loop(args.model, args.cut, args.dataset, args.data_dir)
    for rep in range(args.reps):
        for threads in args.threads:
            torch.set_num_threads(threads)
            rate, cpu = loop.rate(args.warm, args.steps)
            line = {"rep": rep, "threads": threads, "rate": rate, "cpu_per_step": cpu}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
