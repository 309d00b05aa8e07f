"""Named state slices: `load_partial` round trips and refuses what does not fit."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from models.errors import StateDictError
from models.parts import ServerModel
from models.registry import build_model
from models.split import SplitNet
from models.state import client_state, head_state, load_partial, range_state, server_state


def two_models() -> tuple[SplitNet, SplitNet]:
    """Two cnn5s with different weights and different BatchNorm statistics."""
    torch.manual_seed(1)
    a, b = build_model("cnn5"), build_model("cnn5")
    with torch.no_grad():  # give the buffers values that differ too
        for name, buf in a.named_buffers():
            if name.endswith("running_mean"):
                buf.uniform_(-1, 1)
    return a, b


def snapshot(net: SplitNet) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in net.state_dict().items()}


def test_client_state_round_trips_into_another_model() -> None:
    a, b = two_models()
    before = snapshot(b)
    sent = {
        k: v.clone()
        for k, v in {**client_state(a, "block2"), **head_state(a, ["block1", "block2"])}.items()
    }
    load_partial(b, sent)
    after = b.state_dict()
    for name, value in after.items():
        if name in sent:
            assert torch.equal(value, sent[name]), name
        else:
            assert torch.equal(value, before[name]), name
    assert any(k.endswith("running_mean") for k in sent)
    assert any(k.startswith("heads.block1.") for k in sent)


def test_server_state_loads_into_a_server_model_by_full_names() -> None:
    a, b = two_models()
    server_b = ServerModel(b, "block1")
    load_partial(server_b, {**server_state(a, "block1"), **head_state(a, a.cuts[1:])})
    x = torch.randn(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    a.eval()
    b.eval()
    with torch.no_grad():
        z = a.client_blocks("block1")(x)
        assert torch.equal(server_b(z), ServerModel(a, "block1")(z))
        # b's client side was not touched
        assert not torch.equal(b.client_blocks("block1")(x), z)


def test_range_and_head_slices() -> None:
    a, _ = two_models()
    middle = range_state(a, 1, 3)
    assert {k.split(".")[1] for k in middle} == {"1", "2"}
    assert set(head_state(a, ["block3"])) == {"heads.block3.fc.weight", "heads.block3.fc.bias"}
    assert head_state(a, []) == {}


def test_slices_share_storage_with_the_model() -> None:
    a, _ = two_models()
    weight = client_state(a, "block1")["blocks.0.conv.weight"]
    assert weight.data_ptr() == a.get_parameter("blocks.0.conv.weight").data_ptr()
    assert not weight.requires_grad


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"blocks.9.conv.weight": torch.zeros(1)}, "1 unknown names: blocks.9.conv.weight"),
        (
            {"blocks.0.conv.weight": torch.zeros(10, 1, 3, 3)},
            r"\(10, 1, 3, 3\) \(model has \(10, 1, 5, 5\)\)",
        ),
        ({"blocks.0.conv.bias": [0.0] * 10}, "not tensors: blocks.0.conv.bias"),
    ],
)
def test_load_partial_refuses_bad_entries_without_loading_anything(
    bad: dict[str, object], message: str
) -> None:
    a, b = two_models()
    before = snapshot(b)
    state: dict[str, object] = {**client_state(a, "block1"), **bad}
    with pytest.raises(StateDictError, match=message):
        load_partial(b, state)  # type: ignore[arg-type]
    for name, value in b.state_dict().items():
        assert torch.equal(value, before[name]), name  # the good entries were not applied either


def test_load_partial_error_lists_a_bounded_number_of_names() -> None:
    _, b = two_models()
    junk = {f"nope.{i}": torch.zeros(1) for i in range(8)}
    with pytest.raises(StateDictError, match=r"8 unknown names: .* and 3 more") as info:
        load_partial(b, junk)
    assert "nope.7" not in str(info.value)
    assert isinstance(info.value, ValueError)
