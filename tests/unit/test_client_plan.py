"""The client's training plan (settings overridden by the service's config) and its backoff."""

from __future__ import annotations

import random

import pytest
import torch

from broker.transport import Backoff
from services.client.plan import RoundPlan, config_int
from tests.unit.test_client_peers import make_settings


def test_service_config_overrides_the_settings() -> None:
    plan = RoundPlan.from_settings(make_settings("j"))
    updated = plan.updated(
        {
            "algorithm": "minibatch_sfl",
            "batch_size": 8,
            "lr": 1,  # an int is a fine learning rate
            "smashed_dtype": "bfloat16",
            "partition": 3,  # not the plan's business
        }
    )

    assert (updated.algorithm, updated.batch_size, updated.hyper.lr) == ("minibatch_sfl", 8, 1.0)
    assert updated.wire_dtype is torch.bfloat16
    assert updated.hyper.local_epochs == plan.hyper.local_epochs


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"local_epochs": 1.5}, "local_epochs"),
        ({"lr": "fast"}, "lr"),
        ({"lr": -0.1}, "lr > 0"),
        ({"momentum": 1.0}, "momentum"),
        ({"smashed_dtype": "int8"}, "smashed_dtype"),
        ({"algorithm": "sgd"}, "unknown algorithm"),
    ],
)
def test_bad_config_values_are_refused(config: dict[str, object], message: str) -> None:
    plan = RoundPlan.from_settings(make_settings("j"))
    with pytest.raises(ValueError, match=message):
        plan.updated(config)  # type: ignore[arg-type]


def test_config_int() -> None:
    assert config_int({"partition": 4}, "partition") == 4
    assert config_int({}, "partition") is None
    with pytest.raises(ValueError, match="partition"):
        config_int({"partition": -1}, "partition")


def test_backoff_grows_to_its_cap_with_jitter() -> None:
    backoff = Backoff(initial=0.1, cap=1.0)
    rng = random.Random(0)
    for attempt in range(12):
        cap = min(1.0, 0.1 * 2**attempt)
        delays = [backoff.delay(attempt, rng) for _ in range(50)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert len(set(delays)) > 1  # jittered, not lockstep
