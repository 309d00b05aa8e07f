"""Non-sequential models split with torch.fx at named modules (`models.fxsplit`), and the
example factory `examples/models/small_resnet.py` through a file spec and `[model.options]`."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import ModelSpecError
from models.fxsplit import split_module
from models.registry import build_model
from models.state import client_state, server_state
from tests.unit.test_models_custom import assert_split_is_exact

SHAPE = (3, 8, 8)
RESNET = f"{Path(__file__).resolve().parents[2] / 'examples/models/small_resnet.py'}:small_resnet"


class Block(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.bn(self.conv(x)) + x)


class TinyResNet(nn.Module):
    """Residual blocks inside stages, pooling and flatten in forward: not children in order."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.layer1 = nn.Sequential(Block(4), Block(4))
        self.layer2 = nn.Sequential(Block(4), Block(4))
        self.fc = nn.Linear(4, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(F.relu(self.stem(x))))
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


class SkipAcross(TinyResNet):
    """A long skip from the stem's output around layer1: no cut at layer1 or inside it."""

    def forward(self, x: Tensor) -> Tensor:
        h = F.relu(self.stem(x))
        x = self.layer2(self.layer1(h) + h)
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


class Branchy(TinyResNet):
    """Control flow on a tensor value in the root forward: fx cannot trace it."""

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer1(self.stem(x))
        if x.sum() > 0:
            x = self.layer2(x)
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


class Tied(TinyResNet):
    """The same module on both sides of layer1."""

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer2(self.layer1(self.layer2(self.stem(x))))
        out: Tensor = self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
        return out


def split(module: nn.Module, cuts: list[str]) -> object:
    return split_module(module, cuts, input_shape=SHAPE, num_classes=5)


def test_a_residual_model_splits_at_named_modules_and_keeps_its_forward() -> None:
    original = TinyResNet()
    x = torch.randn(4, *SHAPE, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = original.eval()(x)
    net = split_module(original.train(), ["layer1", "layer2.0"], input_shape=SHAPE, num_classes=5)
    assert net.block_names == ("layer1", "layer2_0", "fc")
    assert net.cuts == ("layer1", "layer2_0")
    assert net.cut_shape("layer1") == (4, 8, 8)
    with torch.no_grad():
        assert torch.equal(net.eval()(x), expected)
    assert_split_is_exact(net.train())
    # The blocks hold the original modules under their own qualified names.
    assert net.blocks[1].get_submodule("layer2.0") is original.layer2[0]
    names = set(net.state_dict())
    assert {"blocks.0.stem.weight", "blocks.0.layer1.1.bn.running_mean"} <= names
    assert {"blocks.1.layer2.0.conv.weight", "blocks.2.layer2.1.conv.weight"} <= names
    assert {"blocks.2.fc.bias", "heads.layer1.fc.weight", "heads.layer2_0.fc.weight"} <= names


def test_state_names_are_the_same_in_every_build() -> None:
    # Every role builds the model on its own and they exchange weights by name.
    first = split(TinyResNet(), ["layer1"])
    second = split(TinyResNet(), ["layer1"])
    assert isinstance(first, nn.Module) and isinstance(second, nn.Module)
    assert list(first.state_dict()) == list(second.state_dict())
    second.load_state_dict(first.state_dict())
    replica = copy.deepcopy(second)  # what a worker does with its template
    assert list(replica.state_dict()) == list(first.state_dict())


def test_client_and_server_states_partition_the_blocks() -> None:
    net = split_module(TinyResNet(), ["layer1"], input_shape=SHAPE, num_classes=5)
    client, server = set(client_state(net, "layer1")), set(server_state(net, "layer1"))
    assert not client & server
    assert "blocks.0.layer1.0.conv.weight" in client and "blocks.1.fc.weight" in server


@pytest.mark.parametrize(
    ("model", "cuts", "message"),
    [
        (SkipAcross(), ["layer1"], "the result of 'relu' is used after the cut 'layer1'"),
        (SkipAcross(), ["layer1.0"], "the result of 'relu' is used after the cut 'layer1.0'"),
        (Tied(), ["layer1"], "'layer2.0.conv.weight' is used on both sides of the cut 'layer1'"),
        (TinyResNet(), ["layer1", "layer1.0"], "'layer1.0' lies inside cut 'layer1'"),
        (TinyResNet(), ["layer3"], "'layer3' is not a submodule of TinyResNet.*'layer2', 'fc'"),
        (TinyResNet(), ["fc"], "cannot cut after 'fc'"),
    ],
)
def test_splits_that_would_change_the_model_are_refused(
    model: nn.Module, cuts: list[str], message: str
) -> None:
    with pytest.raises(ModelSpecError, match=message):
        split(model, cuts)


def test_an_untraceable_model_gets_the_fallback_suggested() -> None:
    with pytest.raises(ModelSpecError, match=r"torch.fx cannot trace Branchy.*return \(name, nn"):
        split(Branchy(), ["layer1"])


def test_only_the_enclosing_forwards_are_traced() -> None:
    # Branchy's control flow is in the root: tracing through it fails however it is cut, but a
    # data-dependent forward inside a module that holds no cut is kept whole.
    class Gate(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x if x.sum() > 0 else -x

    model = TinyResNet()
    model.layer2.append(Gate())
    net = split(model, ["layer1"])
    assert isinstance(net, nn.Module)


def test_the_example_resnet_builds_from_its_file_with_options() -> None:
    net = build_model(RESNET, num_classes=10, in_channels=1, input_size=28, width=4, blocks=2)
    assert net.cuts == ("stem", "layer1", "layer2")
    assert net.cut_shape("layer1") == (4, 28, 28)
    assert net.cut_shape("layer2") == (8, 14, 14)
    assert "blocks.1.layer1.1.conv2.weight" in net.state_dict()  # blocks=2 reached it
    wider = build_model(RESNET, num_classes=10, in_channels=1, input_size=28, width=8)
    assert wider.cut_shape("layer1") == (8, 28, 28)
    with pytest.raises(ModelSpecError, match=r"does not accept options.*'depth'.*'width'"):
        build_model(RESNET, num_classes=10, in_channels=1, input_size=28, depth=3)


def test_a_split_model_takes_a_u_shaped_tail() -> None:
    net = split_module(TinyResNet(), ["stem", "layer1"], input_shape=SHAPE, num_classes=5)
    net.set_tail("fc", "stem")
    assert net.server_blocks("stem")[0] is net.blocks[1]  # layer1 on the server
    x = torch.randn(2, *SHAPE)
    with torch.no_grad():
        u = net.tail_blocks()(net.server_blocks("stem")(net.client_blocks("stem")(x)))
        assert torch.equal(u, net(x))
