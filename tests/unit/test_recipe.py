"""The training recipe: `[optimizer]`, `[schedule]` and `[loss]` checked at load time, the lr
a round or a step trains with, the loss on both sides, the recipe's trip to a client, and an
Adam replica's state through a checkpoint."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from broker.errors import EncodeError
from broker.memory_store import InMemoryWeightStore
from broker.store import Checkpoint
from broker.store_codec import OPTIMIZER_PREFIX, decode_checkpoint, encode_checkpoint
from services.algorithms.base import Hyper
from services.algorithms.sfl import weighted_step
from services.algorithms.training import LossSection, OptimizerSection, ScheduleSection
from services.client.plan import RoundPlan
from services.common.handout import client_config
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from workers.replica import Replica

CUT = "block1"


def settings(**sections: Any) -> Settings:
    return Settings.model_validate({"model": {"name": "cnn5", "cut": CUT}, **sections})


def refusal(**sections: Any) -> str:
    with pytest.raises(ValueError) as info:
        settings(**sections)
    return str(info.value)


def params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(3))]


def lr(optimizer: torch.optim.Optimizer) -> float:
    value = optimizer.param_groups[0]["lr"]
    assert isinstance(value, float)
    return value


# --- load-time checks -------------------------------------------------------------------------
def test_a_full_recipe_loads_with_its_arguments() -> None:
    s = settings(
        optimizer={"name": "AdamW", "lr": 1e-3, "weight_decay": 0.05, "betas": [0.9, 0.99]},
        schedule={"name": "cosineannealinglr", "T_max": 30},
        loss={"label_smoothing": 0.1},
    )
    optimizer = job_hyper(s).client_optimizer(params())
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert group["weight_decay"] == 0.05 and group["betas"] == (0.9, 0.99)


def test_an_unknown_optimizer_gets_the_nearest_name() -> None:
    message = refusal(optimizer={"name": "adamx"})
    assert "optimizer.name: torch has no 'adamx': did you mean adamax?" in message


def test_an_unknown_argument_lists_the_accepted_ones() -> None:
    message = refusal(optimizer={"name": "adamw", "betaz": [0.9, 0.99]})
    assert "optimizer.betaz: AdamW takes no argument 'betaz': did you mean betas?" in message
    assert "weight_decay" in message


def test_a_schedule_without_its_required_argument_is_refused() -> None:
    assert "CosineAnnealingLR needs T_max" in refusal(schedule={"name": "cosineannealinglr"})
    message = refusal(schedule={"name": "onecyclelr", "max_lr": 0.1})
    assert "schedule: torch refuses it" in message and "total_steps" in message


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"schedule": {"name": "lambdalr"}}, "LambdaLR takes a Python function"),
        ({"schedule": {"name": "reducelronplateau"}}, "validation metric"),
        ({"optimizer": {"name": "lbfgs"}}, "needs a closure"),
        ({"schedule": {"name": "steplr", "step_size": 2, "last_epoch": 3}}, "set by SplitMQ"),
        ({"optimizer": {"lr": 0.1}}, "optimizer: arguments ['lr'] but no name"),
        ({"optimizer": {"name": "sgd", "lr": {"a": 1}}}, "must be a number"),
        ({"loss": {"label_smothing": 0.1}}, "did you mean label_smoothing?"),
        ({"loss": {"name": "nowhere.losses:focal"}}, "is its directory on PYTHONPATH"),
    ],
)
def test_what_the_recipe_cannot_drive_is_refused(sections: dict[str, Any], expected: str) -> None:
    assert expected in refusal(**sections)


def test_the_sgd_settings_and_an_optimizer_are_not_both_given() -> None:
    message = refusal(algorithm={"lr": 0.1}, optimizer={"name": "adam"})
    assert "algorithm.lr and [optimizer] both set the optimizer" in message
    message = refusal(algorithm={"server_lr": 0.1}, optimizer={"server": {"name": "adam"}})
    assert "algorithm.server_lr and [optimizer.server]" in message
    # Only the server's own optimizer: the client keeps the SGD of [algorithm].
    s = settings(algorithm={"lr": 0.1, "momentum": 0.5}, optimizer={"server": {"name": "adam"}})
    hyper = job_hyper(s)
    assert type(hyper.client_optimizer(params())) is torch.optim.SGD
    assert type(hyper.server_optimizer(params())) is torch.optim.Adam


def test_feddeper_keeps_to_sgd() -> None:
    message = refusal(algorithm={"name": "feddeper"}, optimizer={"name": "adam"})
    assert "algorithm feddeper is written for the client optimizer sgd" in message
    s = settings(algorithm={"name": "feddeper"}, optimizer={"name": "SGD", "weight_decay": 1e-4})
    assert s.optimizer.name == "SGD"


def test_without_a_recipe_the_optimizers_are_the_sgd_of_algorithm() -> None:
    hyper = job_hyper(settings(algorithm={"lr": 0.1, "momentum": 0.9, "server_lr": 0.3}))
    client, server = hyper.client_optimizer(params()), hyper.server_optimizer(params())
    assert type(client) is torch.optim.SGD and type(server) is torch.optim.SGD
    assert (lr(client), lr(server)) == (0.1, 0.3)
    assert client.param_groups[0]["momentum"] == 0.9


# --- schedules ------------------------------------------------------------------------------
def scheduled_lrs(schedule: dict[str, Any], steps: int, base: float = 0.1) -> list[float]:
    """What torch's scheduler on one optimizer gives after 0, 1, ... steps."""
    optimizer = torch.optim.SGD(params(), lr=base)
    cls = getattr(torch.optim.lr_scheduler, schedule.pop("cls"))
    scheduler = cls(optimizer, **schedule)
    out = []
    for _ in range(steps):
        out.append(lr(optimizer))
        optimizer.step()
        scheduler.step()
    return out


def test_a_per_round_schedule_gives_round_r_the_lr_after_r_steps() -> None:
    s = settings(
        optimizer={"name": "sgd", "lr": 0.1},
        schedule={"name": "cosineannealinglr", "T_max": 5},
    )
    hyper = job_hyper(s)
    want = scheduled_lrs({"cls": "CosineAnnealingLR", "T_max": 5}, 6)
    got = [lr(hyper.at_round(r, steps=4).client_optimizer(params())) for r in range(6)]
    assert got == want and len(set(got)) == 6
    # Per round: the optimizer's own steps leave the lr alone.
    optimizer = hyper.at_round(2, steps=4).client_optimizer(params())
    optimizer.step()
    assert lr(optimizer) == want[2]


def test_a_per_step_schedule_runs_on_across_rounds() -> None:
    s = settings(
        optimizer={"name": "adam", "lr": 0.01},
        schedule={"name": "steplr", "step_size": 2, "gamma": 0.5, "every": "step"},
    )
    hyper = job_hyper(s)
    want = scheduled_lrs({"cls": "StepLR", "step_size": 2, "gamma": 0.5}, 9, base=0.01)
    got = []
    for r in range(3):  # three rounds of three steps, each with a fresh optimizer
        optimizer = hyper.at_round(r, steps=3).client_optimizer(params())
        for _ in range(3):
            got.append(lr(optimizer))
            optimizer.step()
    assert got == want and len(set(got)) == 5


def test_the_server_schedule_follows_the_version_or_the_replicas_steps() -> None:
    s = settings(
        optimizer={"name": "sgd", "lr": 0.1, "server": {"name": "sgd", "lr": 0.2}},
        schedule={
            "name": "",
            "server": {"name": "exponentiallr", "gamma": 0.5, "every": "round"},
        },
    )
    hyper = job_hyper(s)
    assert lr(hyper.client_optimizer(params())) == 0.1  # the client has no schedule
    assert [lr(hyper.server_optimizer(params(), version=v)) for v in (1, 2, 4)] == [
        0.2,
        0.1,
        0.025,
    ]
    per_step = settings(schedule={"name": "steplr", "step_size": 1, "gamma": 0.5, "every": "step"})
    server = job_hyper(per_step).server_optimizer(params(), version=9, steps=3)
    assert lr(server) == 0.01 * 0.5**3


# --- losses ---------------------------------------------------------------------------------
def test_label_smoothing_changes_the_loss_on_both_sides() -> None:
    logits, y = torch.randn(8, 10, generator=torch.Generator().manual_seed(0)), torch.arange(8)
    plain = job_hyper(settings()).loss(logits, y)
    smoothed = job_hyper(settings(loss={"label_smoothing": 0.2})).loss(logits, y)
    assert torch.equal(plain, F.cross_entropy(logits, y))
    assert torch.equal(smoothed, F.cross_entropy(logits, y, label_smoothing=0.2))
    assert not torch.equal(plain, smoothed)
    # The server's step trains with it too: its reported loss is the smoothed one.
    server = nn.Linear(10, 10)
    with torch.no_grad():
        expected = float(F.cross_entropy(server(logits), y, label_smoothing=0.2))
        unsmoothed = float(F.cross_entropy(server(logits), y))
    optimizer = torch.optim.SGD(server.parameters(), lr=0.1)
    smoothing = job_hyper(settings(loss={"label_smoothing": 0.2})).loss
    step = weighted_step(server, optimizer, [logits], [y], [1.0], loss=smoothing)
    assert step.losses[0] == pytest.approx(expected, abs=1e-6)
    assert step.losses[0] != pytest.approx(unsmoothed, abs=1e-3)


def test_a_user_loss_function_is_called_with_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "recipe_user_loss.py").write_text(
        textwrap.dedent(
            """
            import torch.nn.functional as F

            CALLS = []

            def scaled(logits, labels, scale=1.0):
                CALLS.append(scale)
                return scale * F.cross_entropy(logits, labels)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    s = settings(loss={"name": "recipe_user_loss:scaled", "scale": 3.0})
    logits, y = torch.randn(4, 10), torch.arange(4)
    got = job_hyper(s).loss(logits, y)
    assert torch.allclose(got, 3.0 * F.cross_entropy(logits, y))
    assert sys.modules["recipe_user_loss"].CALLS == [3.0]
    assert "takes no argument 'gamma'" in refusal(
        loss={"name": "recipe_user_loss:scaled", "gamma": 2}
    )


# --- the client's config ------------------------------------------------------------------------
def test_the_recipe_travels_to_a_client_in_its_config() -> None:
    service = settings(
        optimizer={"name": "adamw", "lr": 1e-3, "weight_decay": 0.05, "betas": [0.9, 0.99]},
        schedule={"name": "steplr", "step_size": 3, "every": "step"},
        loss={"label_smoothing": 0.1},
    )
    config = client_config(service, 0)
    assert all(isinstance(config[k], str) for k in ("optimizer", "schedule", "loss"))
    # The client's own file has no recipe: the service's word wins.
    plan = RoundPlan.from_settings(settings()).updated(config)
    assert plan.hyper.optimizers == service.optimizer
    assert plan.hyper.schedules == service.schedule
    assert plan.hyper.losses == service.loss
    optimizer = plan.hyper.client_optimizer(params())
    assert type(optimizer) is torch.optim.AdamW
    assert optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    # And a service without one sends the plain recipe, replacing a client's own.
    own = RoundPlan.from_settings(service)
    back = own.updated(client_config(settings(), 0)).hyper
    assert back.optimizers == OptimizerSection() and back.losses == LossSection()
    assert back.schedules == ScheduleSection()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"optimizer": 3}, "config.optimizer: expected the table as a JSON string"),
        ({"optimizer": "{not json"}, "config.optimizer:"),
        ({"schedule": '{"name": "steplr", "every": "epoch"}'}, "config.schedule:"),
        ({"optimizer": '{"name": "adamx"}'}, "the service's recipe is unusable here"),
    ],
)
def test_a_bad_recipe_from_the_service_is_a_clear_error(
    entry: dict[str, Any], expected: str
) -> None:
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        RoundPlan.from_settings(settings()).updated(entry)


# --- checkpoints ----------------------------------------------------------------------------
ADAM = {"name": "adam", "lr": 0.01, "betas": [0.8, 0.95]}


def adam_replica(s: Settings, model: Any) -> Replica:
    return Replica(0, model, CUT, job_hyper(s).server_optimizer, torch.device("cpu"))


def batches(model: Any, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shape = model.cut_shape(CUT)
    return [
        (torch.randn((8, *shape), generator=gen), torch.randint(0, 10, (8,), generator=gen))
        for _ in range(count)
    ]


def step(replica: Replica, z: torch.Tensor, y: torch.Tensor) -> None:
    weighted_step(replica.server, replica.optimizer, [z], [y], [1.0])
    replica.steps += 1


def test_a_replica_resumes_its_adam_state_from_a_checkpoint() -> None:
    s = settings(
        optimizer=ADAM,
        schedule={"name": "steplr", "step_size": 2, "gamma": 0.5, "every": "step"},
    )
    model = job_model(s, seed=0)
    data = batches(model, 6)
    original = adam_replica(s, model)
    for z, y in data[:3]:
        step(original, z, y)
    saved = original.checkpoint()
    assert {n.rsplit(".", 1)[1] for n in saved.optimizer} == {"step", "exp_avg", "exp_avg_sq"}
    assert saved.meta["optimizer"] == "Adam"
    store = InMemoryWeightStore()
    store.save_checkpoint("recipe-ckpt", saved)
    loaded = store.load_checkpoint("recipe-ckpt", 0)
    assert loaded is not None
    heir = adam_replica(s, model)
    heir.restore(loaded)
    assert lr(heir.optimizer) == lr(original.optimizer) == 0.01 * 0.5
    for z, y in data[3:]:
        step(original, z, y)
        step(heir, z, y)
    mine, theirs = original.server.state_dict(), heir.server.state_dict()
    assert all(torch.equal(mine[n], theirs[n]) for n in mine)
    # Without the moments (a checkpoint from before they were kept) the heir drifts away.
    amnesiac = adam_replica(s, model)
    amnesiac.restore(Checkpoint(0, loaded.applied, loaded.weights, loaded.meta))
    for z, y in data[3:]:
        step(amnesiac, z, y)
    forgetful = amnesiac.server.state_dict()
    assert max(float((forgetful[n] - mine[n]).abs().max()) for n in mine) > 1e-4


def test_another_optimizers_state_is_not_loaded() -> None:
    adam = settings(optimizer=ADAM)
    model = job_model(adam, seed=0)
    replica = adam_replica(adam, model)
    z, y = batches(model, 1)[0]
    step(replica, z, y)
    saved = replica.checkpoint()
    sgd = settings(algorithm={"momentum": 0.9})
    other = Replica(0, model, CUT, job_hyper(sgd).server_optimizer, torch.device("cpu"))
    other.restore(saved)
    assert type(other.optimizer) is torch.optim.SGD and not other.optimizer.state


def test_the_optimizer_state_shares_the_checkpoints_blob_under_its_prefix() -> None:
    weights = {"blocks.1.w": torch.ones(2)}
    optimizer = {"blocks.1.w.exp_avg": torch.full((2,), 0.5)}
    data, sha, meta = encode_checkpoint(Checkpoint(0, 1, weights, {}, optimizer=optimizer))
    back = decode_checkpoint("ckpt", 0, 1, data, sha, meta, 0.0)
    assert set(back.weights) == {"blocks.1.w"} and set(back.optimizer) == set(optimizer)
    assert torch.equal(back.optimizer["blocks.1.w.exp_avg"], optimizer["blocks.1.w.exp_avg"])
    with pytest.raises(EncodeError, match=r"optimizer's prefix"):
        encode_checkpoint(Checkpoint(0, 1, {OPTIMIZER_PREFIX + "x": torch.ones(1)}, {}))


def test_hyper_without_a_recipe_is_plain_sgd() -> None:
    optimizer = Hyper(lr=0.05, momentum=0.5).client_optimizer(params())
    assert type(optimizer) is torch.optim.SGD and lr(optimizer) == 0.05
