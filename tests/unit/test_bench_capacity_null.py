"""The null-model capacity benchmark's pieces: its model has the size's cut shape, its step is an
identity of the right shapes, and its worker keeps the product's settings otherwise."""

from __future__ import annotations

import torch

from benchmarks.capacity_null import Job, NullSFL, nulled
from benchmarks.rabbitmq_roundtrip import SHAPES
from services.algorithms.base import CohortBatch
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model


def job(size: str) -> Job:
    return Job("capnull-test", size, "amqp://unused", "redis://unused", "cpu")


def test_the_null_model_has_each_sizes_cut_shape() -> None:
    for size, shape in SHAPES.items():
        model = job_model(job(size).settings())
        assert tuple(model.cut_shape("body")) == shape[1:], size


def test_the_null_step_answers_zeros_of_each_batchs_shape_and_dtype() -> None:
    strategy = nulled(build_strategy("sfl_v2", {"lr": 0.5}))
    assert isinstance(strategy, NullSFL) and strategy.name == "sfl_v2"
    z = torch.randn(4, 3, 2, dtype=torch.bfloat16)
    batches = [CohortBatch("c0", z, torch.zeros(4, dtype=torch.long))]
    server = torch.nn.Linear(1, 1)
    before = server.weight.detach().clone()
    optimizer = torch.optim.SGD(server.parameters(), lr=1.0)
    assert strategy.server is not None
    [(grad, loss, correct)] = strategy.server.step(server, optimizer, batches)
    assert grad.shape == z.shape and grad.dtype == z.dtype and not grad.any()
    assert (loss, correct) == (0.0, 0)
    assert torch.equal(server.weight, before)


def test_big_bodies_keep_fewer_in_flight_and_unacked() -> None:
    small, big = job("100KiB"), job("16MiB")
    assert small.window == 32 and small.checkpoint == 50
    assert big.window == 4 and big.checkpoint == 4
    assert big.settings().workers.checkpoint_every_steps == 4
