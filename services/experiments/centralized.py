"""The centralized baseline (`Run(kind="centralized")`, CONTRIBUTING.md): one plain loop, the
same optimiser, schedule and loss as the clients' (the job's recipe).

A round here is the training the federation does in one round: the sum over a cohort of the
clients' local steps (`clients.fraction` of them, each capped by `max_steps_per_round`). The
model is evaluated after each round on the same test samples as the service's aggregator and
the records go to a `MetricsSink`, so its report directory looks like any other run's.
"""

from __future__ import annotations

import itertools
import threading
import time

import torch
from torch import nn

from broker.store import CLIENT_PART, BlobRef
from services.aggregator.evaluation import build_evaluator
from services.aggregator.round_gate import round_half_up
from services.algorithms.base import Hyper, full_state
from services.client.data import JobData, client_batches
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from services.data.batches import ClientBatches
from services.data.loaders import Dataset
from services.report.records import MetricsSink, VersionRecord


def client_steps(data: JobData, settings: Settings) -> list[int]:
    """Local steps per round of each client, exactly as its `round_batches` counts them."""
    algorithm = settings.algorithm
    steps = []
    for k in range(data.clients):
        batches = client_batches(data, k, batch_size=algorithm.batch_size, seed=settings.job.seed)
        total = len(batches) * algorithm.local_epochs
        cap = algorithm.max_steps_per_round
        steps.append(min(total, cap) if cap else total)
    return steps


def steps_per_round(data: JobData, settings: Settings) -> int:
    """The federation's minibatch steps in one round: a cohort's worth of local steps."""
    steps = client_steps(data, settings)
    cohort = max(1, round_half_up(settings.clients.fraction * len(steps)))
    return max(1, round(sum(steps) * cohort / len(steps)))


def union_batches(data: JobData, settings: Settings) -> ClientBatches:
    """Shuffled minibatches over every client's training samples together."""
    train = data.dataset.train
    union = torch.cat([torch.as_tensor(data.indices(k)) for k in range(data.clients)])
    union, _ = torch.sort(union)
    size = settings.algorithm.batch_size
    return ClientBatches(
        train.x,
        train.y,
        union.numpy(),
        batch_size=size,
        seed=settings.job.seed,
        client=0,
        drop_last=len(union) > size and len(union) % size == 1,
        augment=data.augmenter,
    )


def round_optimizer(
    hyper: Hyper, model: nn.Module, previous: torch.optim.Optimizer | None
) -> torch.optim.Optimizer:
    """The service's optimizer for this round (the job's recipe and schedule), carrying on the
    state of the previous round's: one model trains throughout, so its momentum does too."""
    fresh = hyper.client_optimizer(model.parameters())
    if previous is not None:
        saved = fresh.state_dict()
        saved["state"] = previous.state_dict()["state"]
        fresh.load_state_dict(saved)
    return fresh


def train_centralized(
    settings: Settings, dataset: Dataset, sink: MetricsSink, stop: threading.Event
) -> str:
    """Train for `job.rounds` rounds, recording one version per round; the final status."""
    data = JobData(settings, dataset)
    model = job_model(settings, seed=settings.job.seed)  # the service's version 1
    hyper = job_hyper(settings)
    optimizer: torch.optim.Optimizer | None = None
    evaluator = build_evaluator(settings, dataset.test)
    classes = {f"client-{k}": data.classes(k) for k in range(data.clients)}
    per_round = steps_per_round(data, settings)
    batches = union_batches(data, settings)
    stream = itertools.chain.from_iterable(batches.epoch(e) for e in itertools.count())
    started = time.monotonic()
    status = "finished"
    for round_index in range(settings.job.rounds):
        round_start = time.monotonic()
        optimizer = round_optimizer(hyper.at_round(round_index, per_round), model, optimizer)
        model.train()
        samples = correct = 0
        loss_sum = 0.0
        for x, y in itertools.islice(stream, per_round):
            if stop.is_set():
                break
            logits = model(x)
            loss = hyper.loss(logits, y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            samples += int(y.shape[0])
            loss_sum += float(loss.detach()) * int(y.shape[0])
            correct += int((logits.detach().argmax(dim=1) == y).sum())
        if stop.is_set():
            status = "stopped"
            break
        result = evaluator.evaluate({BlobRef(CLIENT_PART): full_state(model)}, classes)
        seconds = time.monotonic() - round_start
        sink.record(
            VersionRecord(
                version=round_index + 2,  # version 1 is the initial model, as in the service
                round=round_index + 1,
                elapsed_s=time.monotonic() - started,
                participants=1,
                global_accuracy=result.global_accuracy,
                global_loss=result.global_loss,
                personal_accuracy=result.personal_accuracy,
                train_loss=loss_sum / samples if samples else float("nan"),
                train_accuracy=correct / samples if samples else float("nan"),
                samples=samples,
                samples_per_s=samples / seconds if seconds > 0 else 0.0,
                bytes_up=0,
                bytes_down=0,
            )
        )
    sink.finish(status)
    return status
