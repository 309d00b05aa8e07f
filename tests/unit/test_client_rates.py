"""The cohort's rate in a version's record counts each client's whole round, waits for its
gradients included; the compute-only rate is reported beside it, under its own name."""

from __future__ import annotations

from services.aggregator.metrics import build_record
from services.algorithms.base import ClientUpdate


def update(client: str, samples: float, wall_s: float, compute_s: float) -> ClientUpdate:
    metrics = {"train_samples": samples, "round_wall_s": wall_s, "compute_s": compute_s}
    return ClientUpdate(client, samples=1000, base_version=1, client_weights={}, metrics=metrics)


def test_the_client_rate_includes_the_wait_for_gradients() -> None:
    # A split client that computed for 1 s of a 4 s round (3 s waiting on the server).
    updates = [update("a", 200, 4.0, 1.0), update("b", 100, 2.0, 0.5)]
    record = build_record(
        version=2, round_index=0, elapsed_s=5.0, updates=updates, evaluation=None, round_s=4.0
    )
    assert record.extra["client_samples_per_s"] == 200 / 4.0 + 100 / 2.0
    assert record.extra["client_compute_samples_per_s"] == 200 / 1.0 + 100 / 0.5


def test_no_rate_when_a_client_does_not_report_its_time() -> None:
    older = ClientUpdate("c", samples=10, base_version=1, client_weights={}, metrics={})
    record = build_record(
        version=2,
        round_index=0,
        elapsed_s=1.0,
        updates=[update("a", 200, 4.0, 1.0), older],
        evaluation=None,
        round_s=4.0,
    )
    assert "client_samples_per_s" not in record.extra
    assert "client_compute_samples_per_s" not in record.extra
