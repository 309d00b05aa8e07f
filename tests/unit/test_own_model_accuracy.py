"""The personalised papers' metric: each client's own model after local training, averaged over
every client that has trained, not over one round's cohort."""

from __future__ import annotations

import math

from services.aggregator.metrics import own_model_accuracy
from services.algorithms.base import ClientUpdate


def update(client: str, **metrics: float) -> ClientUpdate:
    return ClientUpdate(client, samples=10, base_version=1, client_weights={}, metrics=metrics)


def test_the_mean_runs_over_each_clients_latest_report() -> None:
    latest: dict[str, float] = {}
    # Round 1: a and b train. (0.5 + 0.7) / 2 = 0.6.
    assert (
        own_model_accuracy(
            latest, [update("a", personal_accuracy=0.5), update("b", personal_accuracy=0.7)]
        )
        == 0.6
    )
    # Round 2: only c, then a again; a's newer 0.9 replaces its 0.5, b keeps its 0.7:
    # (0.9 + 0.7 + 0.2) / 3 = 0.6 — the cohort alone would say (0.2 + 0.9) / 2 = 0.55.
    value = own_model_accuracy(
        latest, [update("c", personal_accuracy=0.2), update("a", personal_accuracy=0.9)]
    )
    assert math.isclose(value, 0.6)
    assert latest == {"a": 0.9, "b": 0.7, "c": 0.2}


def test_clients_that_report_nothing_leave_it_undefined() -> None:
    latest: dict[str, float] = {}
    # A split client reports no own-model accuracy; a NaN (no local test rows) is no report.
    assert math.isnan(
        own_model_accuracy(latest, [update("a"), update("b", personal_accuracy=math.nan)])
    )
    assert latest == {}
