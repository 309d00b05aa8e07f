"""The checks a client runs on each delivery of its reply queue (`ClientLink.problem`, and
services/client/replies.py for the rarer messages), alone: what belongs on the queue, which
seqs this session sent, and whether the awaited answer fits its batch.
tests/unit/test_bad_input.py covers them through `ClientLink.poll`."""

from __future__ import annotations

import logging
import threading
import time
from typing import cast

import pytest
import torch

from broker.messages import (
    Error,
    GradientReply,
    Leave,
    Message,
    ServerOutput,
    SmashedBatch,
    Welcome,
)
from broker.transport import Broker
from models.split import SplitNet
from services.client.link import ClientLink
from services.client.plan import RoundPlan
from services.client.replies import fit_problem, output_problem
from services.client.stats import ClientStats
from tests.unit.test_client_peers import make_settings, seeded_model

JOB, CLIENT = "j", "c1"


@pytest.fixture(scope="module")
def model() -> SplitNet:
    return seeded_model(make_settings(JOB))


@pytest.fixture(scope="module")
def plan() -> RoundPlan:
    return RoundPlan.from_settings(make_settings(JOB))


def batch(seq: int, rows: int = 4) -> SmashedBatch:
    return SmashedBatch(
        JOB, CLIENT, "m", 1, seq, 0, 0, 0, torch.zeros(rows, 3), torch.zeros(rows).long()
    )


def link(model: SplitNet, plan: RoundPlan, seq_base: int | None, next_seq: int) -> ClientLink:
    """A link whose session numbers its batches from `seq_base` up to `next_seq`; its checks
    never touch the broker."""
    out = ClientLink(
        cast(Broker, None),
        job=JOB,
        client=CLIENT,
        stats=ClientStats(),
        stop=threading.Event(),
        clock=time.monotonic,
        logger=logging.getLogger(__name__),
        heartbeat_s=60.0,
        seq_start=seq_base,
        model=model,
        plan=plan,
    )
    out.next_seq = next_seq
    return out


def reply(seq: int, grad: torch.Tensor | None, status: str = "ok") -> GradientReply:
    return GradientReply(JOB, CLIENT, "r", 1, seq, status, 0.5, 1, 4, grad)


def test_only_a_replys_types_for_this_job_and_client_belong(
    model: SplitNet, plan: RoundPlan
) -> None:
    def problem(message: Message) -> str | None:
        reason, fatal = link(model, plan, 100, 105).problem(message, None)
        assert not fatal
        return reason

    assert problem(Error(JOB, CLIENT, "e", 1, "round_closed", "")) is None
    assert "does not belong" in str(problem(Leave(JOB, CLIENT, "l", 1)))
    assert "for job 'other'" in str(problem(Error("other", CLIENT, "e", 1, "x", "")))
    assert "for client 'c2'" in str(problem(Error(JOB, "c2", "e", 1, "x", "")))
    # Below the session's next seq: a late copy or an older run's, judged a duplicate later.
    assert problem(reply(3, None)) is None
    assert problem(reply(104, None)) is None
    assert "never sent by this client" in str(problem(reply(105, None)))


def test_before_its_welcome_a_client_takes_any_seq(model: SplitNet, plan: RoundPlan) -> None:
    assert link(model, plan, None, 0).problem(reply(10**9, None), None) == (None, False)


def test_a_welcome_must_fit_the_clients_model(model: SplitNet, plan: RoundPlan) -> None:
    own = model.state_dict()
    name = next(iter(own))

    def welcome(weights: dict[str, torch.Tensor], cut: str = "block1") -> Welcome:
        return Welcome(JOB, CLIENT, "w", 1, 0, cut, 0, weights, {}, {}, seq_base=0)

    assert fit_problem(welcome({name: own[name].clone()}), plan, model) is None
    assert "unknown tensor 'nope'" in str(fit_problem(welcome({"nope": own[name]}), plan, model))
    wrong = torch.zeros(own[name].numel() + 1)
    assert f"{name}: shape" in str(fit_problem(welcome({name: wrong}), plan, model))
    assert str(fit_problem(welcome({}, cut="no_such_block"), plan, model)).startswith("Welcome:")


def test_the_awaited_gradient_has_its_batchs_shape(model: SplitNet, plan: RoundPlan) -> None:
    sent = batch(7)

    def gradient_problem(answer: GradientReply, awaiting: SmashedBatch) -> str | None:
        reason, fatal = link(model, plan, 0, 10).problem(answer, awaiting)
        assert fatal or reason is None
        return reason

    assert gradient_problem(reply(7, torch.zeros(4, 3)), sent) is None
    assert gradient_problem(reply(8, None), sent) is None  # not the answer to this batch
    assert gradient_problem(reply(7, None, status="stale"), sent) is None  # not an ok answer
    assert "gradient shape None, expected [4, 3]" in str(gradient_problem(reply(7, None), sent))
    assert "gradient shape [2, 3]" in str(gradient_problem(reply(7, torch.zeros(2, 3)), sent))


def test_a_server_output_has_a_row_per_sample_of_its_batch(model: SplitNet) -> None:
    sent = batch(7)
    rows = ServerOutput(JOB, CLIENT, "o", 1, 7, torch.zeros(4, 10))
    assert output_problem(ServerOutput(JOB, CLIENT, "o", 1, 8, torch.zeros(1)), sent, model) is None
    if model.tail is None:  # no tail: only the rows count
        assert output_problem(rows, sent, model) is None
    short = ServerOutput(JOB, CLIENT, "o", 1, 7, torch.zeros(3, 10))
    assert "ServerOutput seq 7: shape [3, 10]" in str(output_problem(short, sent, model))
