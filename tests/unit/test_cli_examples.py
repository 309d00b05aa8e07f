"""The example configurations load and say what their names promise."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.config.loading import load_settings
from services.config.root import Settings

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> Settings:
    return load_settings(EXAMPLES / name, {})


@pytest.mark.parametrize(
    ("name", "algorithm", "shards"),
    [
        ("quickstart.toml", "sfl_v2", 1),
        ("service.toml", "sfl_v2", 1),
        ("fedavg.toml", "fedavg", 1),
        ("sfl_v1.toml", "sfl_v1", 4),
        ("minibatch_sfl.toml", "minibatch_sfl", 1),
        ("sharded_sfl.toml", "sfl", 2),
        ("subfedavg.toml", "subfedavg", 1),
        ("splitgp.toml", "splitgp", 2),
        ("fedsplitx.toml", "fedsplitx", 1),
        ("local_loss_sfl.toml", "local_loss_sfl", 1),
        ("feddeper.toml", "feddeper", 1),
        ("async.toml", "sfl", 2),
        ("privacy.toml", "sfl_v2", 1),
        ("byo_model.toml", "sfl_v2", 1),
        ("recipe.toml", "sfl_v2", 1),
    ],
)
def test_example_loads(name: str, algorithm: str, shards: int) -> None:
    settings = load(name)
    assert settings.algorithm.name == algorithm
    assert settings.shards == shards
    assert settings.clients.min_to_start <= settings.clients.count


def test_every_example_is_covered() -> None:
    names = {p.name for p in EXAMPLES.glob("*.toml")}
    assert names == {
        "quickstart.toml",
        "service.toml",
        "fedavg.toml",
        "sfl_v1.toml",
        "minibatch_sfl.toml",
        "sharded_sfl.toml",
        "subfedavg.toml",
        "splitgp.toml",
        "fedsplitx.toml",
        "local_loss_sfl.toml",
        "feddeper.toml",
        "async.toml",
        "privacy.toml",
        "byo_model.toml",
        "recipe.toml",
    }


def test_quickstart_is_the_readme_job() -> None:
    s = load("quickstart.toml")
    assert (s.model.name, s.data.dataset, s.clients.count, s.workers.count) == (
        "cnn5",
        "fashion_mnist_sample",
        4,
        1,
    )
    assert 3 <= s.job.rounds <= 4
    assert s.broker.kind == "memory" and s.store.kind == "memory"


def test_service_example_is_the_quickstart_over_real_servers() -> None:
    service, quick = load("service.toml"), load("quickstart.toml")
    assert service.broker.kind == "rabbitmq" and service.store.kind == "redis"
    assert service.model == quick.model and service.algorithm == quick.algorithm
    assert service.job.rounds == quick.job.rounds


def test_the_async_example_runs_without_rounds() -> None:
    s = load("async.toml")
    assert s.asynchronous_mode and s.buffer_size == 4
    assert s.asynchronous.max_staleness < s.store.keep_versions
