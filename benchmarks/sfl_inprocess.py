"""The in-process SFL-V2 loop the MQ deployment is compared with; runs in a process of its own.

    python -m benchmarks.sfl_inprocess --model cnn5 --cut block1 --dataset fashion_mnist \
        --threads 1 2 --reps 3 --warm 8 --steps 80

One process, no broker: four clients' bodies (copies of the same initial model) and one server
side, stepping exactly as SFL-V2 does over the wire — client forward, the worker's server step
(`SFLServer.step`: forward, backward, optimizer step, dL/dz), client backward and step —
cycling over the four clients' batches in turn. Data, partition (IID over 4 clients), batch
size, optimizer and learning rate are the deployment's. Each repetition times `steps` steps
after `warm` untimed ones, at each thread count in turn; prints one JSON line per repetition.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from benchmarks.sfl_deploy import BATCH, CLIENTS
from models.parts import ServerModel
from services.algorithms.base import CohortBatch, Hyper
from services.algorithms.sfl import SFLServer
from services.client.data import JobData, client_batches
from services.common.jobmodel import job_model
from services.config.loading import load_settings
from services.data.batches import Batch, ClientBatches


class Loop:
    """The whole SFL-V2 job in one process."""

    def __init__(
        self,
        model: str,
        cut: str,
        dataset: str,
        data_dir: Path,
        *,
        clients: int = CLIENTS,
        batch: int = BATCH,
        train_samples: int = 0,
    ) -> None:
        settings = load_settings(
            None,
            {
                "SPLITMQ_MODEL__NAME": model,
                "SPLITMQ_MODEL__CUT": cut,
                "SPLITMQ_DATA__DATASET": dataset,
                "SPLITMQ_DATA__DIR": str(data_dir),
                "SPLITMQ_DATA__TRAIN_SAMPLES": str(train_samples),
                "SPLITMQ_ALGORITHM__BATCH_SIZE": str(batch),
                "SPLITMQ_CLIENTS__COUNT": str(clients),
            },
        )
        self.clients, self.batch = clients, batch
        net = job_model(settings)
        hyper = Hyper(lr=settings.algorithm.lr, momentum=settings.algorithm.momentum)
        self.server_side = SFLServer()
        self.server = ServerModel(copy.deepcopy(net), cut)
        self.server.train()
        self.server_opt = hyper.server_optimizer(self.server.parameters())
        self.bodies = []
        for _ in range(clients):
            body = copy.deepcopy(net).client_blocks(cut)
            body.train()
            self.bodies.append((body, hyper.client_optimizer(body.parameters())))
        data = JobData(settings)
        self.batches = [
            _forever(client_batches(data, k, batch_size=batch, seed=settings.job.seed))
            for k in range(clients)
        ]
        self.turn = 0

    def step(self) -> None:
        k = self.turn % self.clients
        self.turn += 1
        x, y = next(self.batches[k])
        body, optimizer = self.bodies[k]
        z = body(x)
        batch = CohortBatch(f"client-{k}", z.detach(), y, float(y.shape[0]))
        [(grad, _loss, _correct)] = self.server_side.step(self.server, self.server_opt, [batch])
        optimizer.zero_grad(set_to_none=True)
        z.backward(grad.to(dtype=z.dtype))
        optimizer.step()

    def rate(self, warm: int, steps: int, max_s: float) -> tuple[float, float, int]:
        """Samples/s and CPU seconds per step over `steps` timed steps, or as many whole
        rounds of the clients as fit in `max_s` seconds (at least one)."""
        for _ in range(warm):
            self.step()
        started, cpu = time.perf_counter(), time.process_time()
        done = 0
        while done < steps:
            self.step()
            done += 1
            if done % self.clients == 0 and time.perf_counter() - started > max_s:
                break
        wall = time.perf_counter() - started
        return done * self.batch / wall, (time.process_time() - cpu) / done, done


def _forever(batches: ClientBatches) -> Iterator[Batch]:
    epoch = 0
    while True:
        yield from batches.epoch(epoch)
        epoch += 1


def measure(loop: Loop, request: dict[str, float]) -> dict[str, float]:
    threads = int(request["threads"])
    torch.set_num_threads(threads)
    rate, cpu, steps = loop.rate(int(request["warm"]), int(request["steps"]), request["max_s"])
    return {"threads": threads, "rate": rate, "cpu_per_step": cpu, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description="in-process SFL-V2 throughput")
    parser.add_argument("--model", required=True)
    parser.add_argument("--cut", required=True)
    parser.add_argument("--dataset", required=True)
    parser.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("SPLITMQ_DATA_DIR", "../shared/data"))
    )
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--train-samples", type=int, default=0, help="0: the whole training set")
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--warm", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--max-s", type=float, default=60.0, help="time box per measurement")
    parser.add_argument(
        "--serve",
        action="store_true",
        help="read one JSON request per stdin line ({threads, warm, steps, max_s}), answer each "
        "with one JSON line: the driver keeps one loaded process across deployments",
    )
    args = parser.parse_args()
    loop = Loop(
        args.model,
        args.cut,
        args.dataset,
        args.data_dir,
        clients=args.clients,
        batch=args.batch,
        train_samples=args.train_samples,
    )
    if args.serve:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            print(json.dumps(measure(loop, json.loads(line))), flush=True)
        return
    for rep in range(args.reps):
        for threads in args.threads:
            request = {"threads": threads, "warm": args.warm, "steps": args.steps}
            print(json.dumps({"rep": rep, **measure(loop, request | {"max_s": args.max_s})}))


if __name__ == "__main__":
    main()
