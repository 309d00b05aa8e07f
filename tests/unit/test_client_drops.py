"""The notice a client sends when it drops a round (services/client/drops.py)."""

from __future__ import annotations

import math

import pytest
import torch

from broker.codec import decode, encode
from broker.errors import EncodeError
from broker.messages import RoundDropped, WeightsAssignment, WeightsUpdate
from services.client.drops import drop_notice, drop_reason
from services.client.errors import RoundAborted


def nan_encode_error() -> EncodeError:
    update = WeightsUpdate("j", "c", "m", 1, 0, 5, {"w": torch.tensor([math.nan])}, {})
    with pytest.raises(EncodeError) as caught:
        encode(update)
    return caught.value


def test_a_diverged_model_is_non_finite_anything_else_aborted() -> None:
    # The codec's own wording, for weights (EncodeError) and activations (wrapped by the channel).
    refused = nan_encode_error()
    assert drop_reason(refused) == "non_finite"
    assert drop_reason(RoundAborted(f"step 2: cannot send smashed data: {refused}")) == "non_finite"
    assert drop_reason(RoundAborted("round 0: no gradient for seq 4 after 3 tries")) == "aborted"


def test_the_notice_answers_its_assignment_and_travels() -> None:
    assignment = WeightsAssignment("j", "c", "assign-1", 4, 3, True, {}, {}, {})
    notice = drop_notice("j", "c", assignment, RoundAborted("x" * 1000))
    assert (notice.version, notice.round, notice.ref_message_id) == (4, 3, "assign-1")
    assert notice.reason == "aborted" and len(notice.detail) == 300
    assert decode(encode(notice)) == notice
    assert isinstance(notice, RoundDropped)
