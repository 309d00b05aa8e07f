"""`data.distinct_shards`: the shards partitioner's random deal of Sub-FedAvg's text (a client
may get two shards of one label) against the default deal of distinct labels."""

from __future__ import annotations

import numpy as np

from services.config.root import Settings
from services.data.partition import partition


def one_label_clients(distinct: bool, seed: int) -> int:
    # 10 labels x 500 samples, shards of 250: 20 shards, two per label, dealt to 10 clients.
    labels = np.repeat(np.arange(10), 500)
    parts = partition(
        labels,
        "shards",
        10,
        seed=seed,
        shards_per_client=2,
        shard_size=250,
        distinct_shards=distinct,
    )
    return sum(len(np.unique(labels[p])) == 1 for p in parts)


def test_a_random_deal_gives_some_clients_one_label_the_default_none() -> None:
    seeds = range(20)
    assert all(one_label_clients(True, s) == 0 for s in seeds)
    # Two shards of one label among 20 shards dealt at random: 10 x 1/19 ≈ 0.5 clients a deal.
    assert sum(one_label_clients(False, s) for s in seeds) > 0


def test_the_setting_reaches_the_partitioner() -> None:
    assert Settings().data.distinct_shards is True
    settings = Settings.model_validate({"data": {"partition": "shards", "distinct_shards": False}})
    assert settings.data.distinct_shards is False
