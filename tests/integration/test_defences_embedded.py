"""The defences on smashed data through the real roles (embedded broker and store): SFL-V2
with each defence on trains above chance, and the SmashedBatches its client publishes differ
from the undefended run's as configured (the noise's statistics, the clip's bound)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from broker.codec import decode
from broker.memory_broker import InMemoryHub, _Message
from broker.messages import SmashedBatch
from broker.topology import SMASHED_EXCHANGE
from models.registry import build_model
from services.aggregator.evaluation import evaluate
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.data.loaders import Dataset, load_dataset
from tests.integration.test_exactness import ROUNDS, cleanup, one_torch_thread, train

__all__ = ["cleanup", "one_torch_thread"]  # fixtures, imported so that they apply here

pytestmark = pytest.mark.slow

SIGMA = 0.3
BOUND = 20.0  # the first batches' norms are about 49: it binds


class TappedHub(InMemoryHub):
    """The embedded hub, keeping every SmashedBatch published (in publish order)."""

    def __init__(self) -> None:
        super().__init__()
        self.smashed: list[SmashedBatch] = []

    def route(self, message: _Message) -> list[str]:
        if message.exchange == SMASHED_EXCHANGE:
            batch = decode(message.body)
            if isinstance(batch, SmashedBatch):
                self.smashed.append(batch)
        return super().route(message)


@dataclass(frozen=True)
class Run:
    accuracy: float
    batches: dict[tuple[int, int], torch.Tensor]  # (round, step) -> the activations sent


@pytest.fixture(scope="module")
def dataset() -> Dataset:
    return load_dataset("fashion_mnist_sample", None)


def settings_for(job: str, privacy: dict[str, Any]) -> Settings:
    """One client (its batches and their order fixed by the seed), cnn5 cut after block1."""
    return Settings.model_validate(
        {
            "job": {"name": job, "seed": 3, "rounds": ROUNDS},
            "model": {"name": "cnn5", "cut": "block1"},
            "data": {"dataset": "fashion_mnist_sample", "eval_samples": 500},
            "algorithm": {
                "name": "sfl_v2",
                "batch_size": 32,
                "lr": 0.05,
                "momentum": 0.9,
                "max_steps_per_round": 12,
            },
            "clients": {"count": 1, "heartbeat_s": 0.5, "heartbeat_ttl_s": 60.0},
            "workers": {"device": "cpu"},
            "privacy": privacy,
        }
    )


def run(
    job: str, privacy: dict[str, Any], dataset: Dataset, opened: list[tuple[Backends, Settings]]
) -> Run:
    settings = settings_for(job, privacy)
    hub = TappedHub()
    backends = Backends(settings.broker, settings.store, Embedded(hub=hub))
    opened.append((backends, settings))
    trained = train(settings, backends, dataset)
    model = build_model("cnn5")
    accuracy = evaluate(model, {**trained.client, **trained.server}, dataset.test).accuracy
    batches = {(b.round, b.step): b.activations.float() for b in hub.smashed}
    return Run(accuracy, batches)


@pytest.fixture(scope="module")
def undefended(dataset: Dataset) -> Iterator[Run]:
    opened: list[tuple[Backends, Settings]] = []
    yield run("defences-off", {}, dataset, opened)


def rows_norms(z: torch.Tensor) -> torch.Tensor:
    norms: torch.Tensor = z.flatten(1).norm(dim=1)
    return norms


def clipped(z: torch.Tensor) -> torch.Tensor:
    return z * (BOUND / rows_norms(z).clamp(min=BOUND)).view(-1, 1, 1, 1)


@pytest.mark.parametrize(
    "privacy",
    [
        {"noise_scale": SIGMA},
        {"clip_norm": BOUND},
        {"clip_norm": BOUND, "noise_scale": SIGMA},
        {"nopeek_weight": 0.5},
    ],
    ids=["noise", "clip", "clip+noise", "nopeek"],
)
def test_sfl_v2_with_a_defence_trains_and_publishes_defended_batches(
    privacy: dict[str, Any],
    undefended: Run,
    dataset: Dataset,
    cleanup: list[tuple[Backends, Settings]],
    job: str,
) -> None:
    defended = run(job, privacy, dataset, cleanup)
    assert undefended.accuracy > 0.3  # 10 classes: chance is 0.1
    assert defended.accuracy > 0.3, f"{privacy}: accuracy {defended.accuracy}"
    assert len(defended.batches) == ROUNDS * 12 and set(defended.batches) == set(undefended.batches)
    # Round 1's first batch comes from the same weights and inputs in both runs: what the
    # defences did to it is all that differs.
    first = min(defended.batches)
    plain, sent = undefended.batches[first], defended.batches[first]
    expected = clipped(plain) if "clip_norm" in privacy else plain
    if "noise_scale" in privacy:
        noise = sent - expected
        # N = 32 * 1440 draws: the sample mean's sd is sigma / 215, the sd's about 0.3%.
        assert abs(float(noise.mean())) < 5 * SIGMA / noise.numel() ** 0.5
        assert float(noise.std()) == pytest.approx(SIGMA, rel=0.03)
    else:
        assert torch.allclose(sent, expected, atol=1e-5)
    if privacy == {"clip_norm": BOUND}:
        norms = torch.cat([rows_norms(z) for z in defended.batches.values()])
        assert float(norms.max()) <= BOUND * (1 + 1e-5)
        assert float(rows_norms(plain).min()) > BOUND  # the clip did bind
    if "nopeek_weight" in privacy:
        # The penalty acts through the backward: the later batches move away.
        last = max(defended.batches)
        assert not torch.allclose(defended.batches[last], undefended.batches[last], atol=1e-4)
