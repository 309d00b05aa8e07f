"""The trained model a run keeps (services/report/final_model.py): whole-model safetensors files
that a freshly built model loads strictly, global and personal."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from broker.memory_store import InMemoryWeightStore
from broker.store import AUX_PART, CLIENT_PART, NO_VERSION, BlobRef
from models.state import client_state
from services.algorithms.registry import build_strategy
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.report.final_model import MODEL_FILE, PERSONAL_DIR, save_final_model


def settings_for(algorithm: str) -> Settings:
    return Settings.model_validate(
        {"data": {"dataset": "fashion_mnist_sample"}, "algorithm": {"name": algorithm}}
    )


def publish(store: InMemoryWeightStore, job: str, settings: Settings, personal: bool) -> None:
    """Version 1 from the strategy's seeded weights, then a version 2 whose weights differ (and,
    with `personal`, with a client's own client and aux blobs)."""
    algo = settings.algorithm
    strategy = build_strategy(algo.name, algo.params())
    model = job_model(settings, seed=1)
    v1 = strategy.initial_weights(model, settings.model.cut)
    store.publish_version(job, NO_VERSION, v1)
    v2 = {
        ref: {k: t + 1.0 if t.is_floating_point() else t for k, t in b.items()}
        for ref, b in v1.items()
    }
    if personal:
        v2[BlobRef(CLIENT_PART, "c7")] = {
            k: torch.zeros_like(t) for k, t in client_state(model, settings.model.cut).items()
        }
        v2[BlobRef(AUX_PART, "c7")] = {
            k: torch.full_like(t, 3.0) for k, t in v1[BlobRef(AUX_PART)].items()
        }
    store.publish_version(job, 1, v2)


def fresh(settings: Settings, path: Path) -> torch.nn.Module:
    model = job_model(settings)
    model.load_state_dict(load_file(path))  # strict: every name, no extra
    return model


def test_the_global_and_personal_models_load_strictly_into_a_fresh_model(tmp_path: Path) -> None:
    settings = settings_for("splitgp")
    store = InMemoryWeightStore()
    publish(store, "j", settings, personal=True)
    template = job_model(settings, seed=1)

    written = save_final_model(tmp_path, store, "j", template)

    assert written == [tmp_path / MODEL_FILE, tmp_path / PERSONAL_DIR / "c7.safetensors"]
    shared = fresh(settings, tmp_path / MODEL_FILE).state_dict()
    own = fresh(settings, tmp_path / PERSONAL_DIR / "c7.safetensors").state_dict()
    for name, t in template.state_dict().items():
        if t.is_floating_point():
            torch.testing.assert_close(shared[name], t + 1.0)  # version 2, not version 1
    cut = settings.model.cut
    for name in client_state(template, cut):
        assert torch.count_nonzero(own[name]) == 0, name  # the client's own blob wins
    heads = [n for n in own if n.startswith("heads.")]
    assert heads and all(torch.all(own[n] == 3.0) for n in heads if own[n].is_floating_point())
    server = [n for n in own if n not in client_state(template, cut) and n not in heads]
    assert server and all(torch.equal(own[n], shared[n]) for n in server)
    with safe_open(tmp_path / MODEL_FILE, framework="pt") as f:
        assert f.metadata()["version"] == "2" and f.metadata()["job"] == "j"


def test_an_unsplit_version_keeps_the_templates_untrained_heads(tmp_path: Path) -> None:
    # FedAvg's versions hold the blocks only; the file must still be the whole state_dict.
    settings = settings_for("fedavg")
    store = InMemoryWeightStore()
    publish(store, "j", settings, personal=False)
    template = job_model(settings, seed=1)

    assert save_final_model(tmp_path, store, "j", template) == [tmp_path / MODEL_FILE]

    state = fresh(settings, tmp_path / MODEL_FILE).state_dict()
    for name, t in template.state_dict().items():
        expected = t + 1.0 if name.startswith("blocks.") and t.is_floating_point() else t
        torch.testing.assert_close(state[name], expected)
    assert not (tmp_path / PERSONAL_DIR).exists()


def test_nothing_is_written_before_version_1_and_a_foreign_model_is_refused(
    tmp_path: Path,
) -> None:
    store = InMemoryWeightStore()
    settings = settings_for("sfl_v2")
    assert save_final_model(tmp_path, store, "j", job_model(settings)) == []
    publish(store, "j", settings, personal=False)
    other = Settings.model_validate(
        {"data": {"dataset": "fashion_mnist_sample"}, "model": {"name": "lenet5"}}
    )
    with pytest.raises(ValueError, match="do not fit the model"):
        save_final_model(tmp_path, store, "j", job_model(other))
    assert not (tmp_path / MODEL_FILE).exists()
