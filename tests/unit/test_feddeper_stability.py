"""Every shipped FedDeper config's recipe stays stable for all of its rounds.

tests/integration/test_examples_finish.py runs each example for 2 rounds of 3 steps, which
cannot see a divergence that builds over tens of rounds: `examples/experiments/feddeper.toml`
at rho = 0.1 peaked near round 9 and went to NaN at round 26 of 30, because under our reading
x is pushed away from the clients along flat directions unless roughly rho * lr * steps > lam
(the config's header and examples/experiments/feddeper.md, Notes). Running that job for real
takes minutes. Instead this drives FedDeper's own client round and aggregation (the code a
client and the aggregator run) with each config's recipe — rho, lam, lr, momentum, batch
size, local steps, rounds and client count, read from the file — for every round, on a linear
model over synthetic 10-class data where each client holds 2 classes, as the experiment's
shards give it. The divergence comes from the update rule, not from the model or the images:
at rho = 0.1 this loop's test loss is lowest after round 8 (the real job peaked at round 9)
and passes 1,000 by round 30; at rho = 1 it falls from 3.2 to 0.9. About 300 client rounds of
a linear model: seconds, not the real job's minutes.
"""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from broker.store import CLIENT_PART, BlobRef
from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import ClientContext, ClientUpdate, LocalRound, full_state
from services.algorithms.registry import build_strategy
from services.config.loading import load_settings
from services.config.root import Settings
from tests.unit.test_client_peers import hyper
from tests.unit.test_feddeper import NoChannel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CONFIGS = [
    path
    for path in sorted(EXAMPLES.glob("**/*.toml"))
    if tomllib.loads(path.read_text()).get("algorithm", {}).get("name") == "feddeper"
]
FEATURES, CLASSES, TEST_PER_CLASS = 8, 10, 50
CLIENT = BlobRef(CLIENT_PART)
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]


def linear_model(seed: int) -> SplitNet:
    torch.manual_seed(seed)
    blocks = [("flat", nn.Flatten()), ("fc", nn.Linear(FEATURES, CLASSES))]
    return SplitNet(blocks, input_shape=(FEATURES,), num_classes=CLASSES)


class TwoClassClients:
    """Gaussian clusters, one per class; client k draws from classes 2k and 2k + 1."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.means = torch.randn(CLASSES, FEATURES, generator=self.generator)

    def sample(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(len(labels), FEATURES, generator=self.generator)
        return self.means[labels] + noise, labels

    def batch(self, client: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        pair = torch.tensor([(2 * client) % CLASSES, (2 * client + 1) % CLASSES])
        return self.sample(pair[torch.randint(0, 2, (size,), generator=self.generator)])

    def test_set(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sample(torch.arange(CLASSES).repeat(TEST_PER_CLASS))


def global_losses(settings: Settings) -> list[float]:
    """The global model's test loss before round 1 and after every round."""
    a, n = settings.algorithm, settings.clients.count
    steps, seed = a.max_steps_per_round, settings.job.seed
    strategy = build_strategy("feddeper", a.params())
    data = TwoClassClients(seed)
    test_x, test_y = data.test_set()
    model, clients = linear_model(seed), [linear_model(seed) for _ in range(n)]
    memories: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
    x = full_state(model)

    def loss() -> float:
        with torch.no_grad():
            return float(F.cross_entropy(model(test_x), test_y))

    losses = [loss()]
    for r in range(settings.job.rounds):
        updates = []
        for k in range(n):
            load_partial(clients[k], x)
            batches = [data.batch(k, a.batch_size) for _ in range(steps)]
            context = ClientContext(f"c{k}", r, memory=memories[k])
            local = LocalRound(
                clients[k], "", iter(batches), steps, NoChannel(), hyper(settings), context
            )
            result = strategy.client_round(local)
            updates.append(
                ClientUpdate(f"c{k}", steps * a.batch_size, r + 1, result.client_weights)
            )
        x = strategy.aggregate({CLIENT: x}, updates, [])[CLIENT]
        load_partial(model, x)
        losses.append(loss())
    return losses


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_the_recipe_does_not_diverge_over_all_its_rounds(path: Path) -> None:
    settings = load_settings(path, {})
    assert settings.algorithm.max_steps_per_round > 0  # the loop runs exactly that many steps
    losses = global_losses(settings)
    assert all(math.isfinite(v) for v in losses), losses
    # Diverging, the loss passes its starting value within a few rounds and keeps growing.
    assert max(losses[1:]) < 2 * losses[0], losses
    assert losses[-1] < losses[0], losses


def test_the_check_catches_the_recipe_that_diverged() -> None:
    """The experiment's base config as it was shipped (rho = 0.1) fails the check above."""
    path = EXAMPLES / "experiments" / "feddeper.toml"
    settings = load_settings(path, {"SPLITMQ_ALGORITHM__FEDDEPER__RHO": "0.1"})
    losses = global_losses(settings)
    assert not losses[-1] < losses[0], losses
