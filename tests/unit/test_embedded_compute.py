"""An embedded run's clients share the process's cores through one `ComputeGate`."""

from __future__ import annotations

import os
import threading

import pytest

from services.client.client import Client
from services.common.backends import Backends, Embedded
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.report.records import ListSink
from services.runtime.roles import embedded_roles


def clients(compute_slots: int | None = 0) -> list[Client]:
    settings = Settings.model_validate(
        {
            "job": {"name": "gate", "rounds": 1},
            "model": {"name": "cnn5"},
            "data": {"dataset": "fashion_mnist_sample"},
            "algorithm": {"name": "fedavg"},
            "clients": {"count": 3},
        }
    )
    backends = Backends(settings.broker, settings.store, Embedded())
    data = load_dataset("fashion_mnist_sample", None)
    specs = embedded_roles(settings, backends, ListSink(), data, compute_slots=compute_slots)
    found = [spec.role for spec in specs if spec.kind == "client"]
    assert all(isinstance(c, Client) for c in found)
    return [c for c in found if isinstance(c, Client)]


def test_whole_model_work_of_an_embedded_run_takes_one_slot_per_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    first, second, _ = clients()
    assert first.compute is not None and second.compute is not None
    entered = threading.Event()

    def compute_in_second() -> None:
        assert second.compute is not None
        with second.compute.held():
            entered.set()

    with first.compute.held():
        other = threading.Thread(target=compute_in_second)
        other.start()
        # One core: the second client waits while the first computes ...
        assert not entered.wait(0.3)
    # ... and goes on once the first is done.
    other.join(5.0)
    assert entered.is_set()


def test_without_slots_every_client_computes_when_it_likes() -> None:
    assert all(c.compute is None for c in clients(compute_slots=None))
