"""Bring-your-own models: factories named by a spec, in the forms `models.custom` accepts.

The factories live in this module and are named through `__name__`, the name pytest imported it
under, so the tests exercise the real import path.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.custom import load_factory
from models.errors import ModelSpecError
from models.fxsplit import split_module
from models.parts import ServerModel
from models.registry import build_model
from models.split import SplitNet
from models.state import client_state, server_state

SHAPE = (1, 8, 8)
SPEC = f"{__name__}:{{}}"


# --- factories --------------------------------------------------------------------------------


def blocks_factory(num_classes: int, hidden: int = 16) -> list[tuple[str, nn.Module]]:
    return [
        ("features", nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())),
        ("pool", nn.Sequential(nn.MaxPool2d(2), nn.Flatten())),
        ("hidden", nn.Sequential(nn.Linear(4 * 4 * 4, hidden), nn.ReLU())),
        ("out", nn.Linear(hidden, num_classes)),
    ]


class Net(nn.Module):
    """A sequential composition of named children."""

    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 12)
        self.fc2 = nn.Linear(12, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.fc2(self.fc1(self.flatten(self.pool(self.relu(self.bn(self.conv(x)))))))
        return out


def module_factory(num_classes: int, input_shape: tuple[int, ...]) -> tuple[nn.Module, list[str]]:
    assert input_shape == SHAPE  # injected because the signature names it
    return Net(num_classes), ["relu", "flatten", "fc1"]


class Residual(Net):
    """Not sequential: `forward` adds a skip connection the children do not express."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.conv = nn.Conv2d(1, 1, 3, padding=1)
        self.bn = nn.BatchNorm2d(1)
        self.fc1 = nn.Linear(16, 12)

    def forward(self, x: Tensor) -> Tensor:
        h = self.relu(self.bn(self.conv(x))) + x
        out: Tensor = self.fc2(self.fc1(self.flatten(self.pool(h))))
        return out


def residual_factory(num_classes: int) -> tuple[nn.Module, list[str]]:
    return Residual(num_classes), ["relu"]


class FlattensInForward(Net):
    """Not a sequence of children: the flatten lives in `forward` (fx splits it all the same)."""

    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        del self.flatten

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(self.relu(self.bn(self.conv(x))))
        out: Tensor = self.fc2(self.fc1(torch.flatten(h, 1)))
        return out


def flattens_factory(num_classes: int) -> tuple[nn.Module, list[str]]:
    return FlattensInForward(num_classes), ["relu"]


class OwnParameter(Net):
    def __init__(self, num_classes: int) -> None:
        super().__init__(num_classes)
        self.scale = nn.Parameter(torch.ones(1))


def own_parameter_factory(num_classes: int) -> tuple[nn.Module, list[str]]:
    return OwnParameter(num_classes), ["relu"]


def split_net_factory(num_classes: int, input_shape: tuple[int, ...]) -> SplitNet:
    return SplitNet(blocks_factory(num_classes), input_shape=input_shape, num_classes=num_classes)


def fixed_split_net_factory() -> SplitNet:
    return SplitNet(blocks_factory(10), input_shape=SHAPE, num_classes=10)


def bare_module_factory() -> nn.Module:
    return Net(10)


def failing_factory() -> list[tuple[str, nn.Module]]:
    raise RuntimeError("out of coffee")


NOT_CALLABLE = 42


# --- helpers ----------------------------------------------------------------------------------


def assert_split_is_exact(net: SplitNet) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((4, *net.input_shape), generator=gen)
    y = torch.randint(0, net.num_classes, (4,), generator=gen)
    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    with torch.no_grad():
        full = net(x)
    for cut in net.cuts:
        client, server = net.client_blocks(cut), ServerModel(net, cut)
        with torch.no_grad():
            assert torch.equal(server(client(x)), full), cut
        net.zero_grad()
        z = client(x)
        z_server = z.detach().requires_grad_()
        F.cross_entropy(server(z_server), y).backward()
        assert z_server.grad is not None
        z.backward(z_server.grad)
        for n, grad in expected.items():
            param_grad = net.get_parameter(n).grad
            assert param_grad is not None, n
            torch.testing.assert_close(param_grad, grad, msg=f"{cut}: {n}")
        assert set(client_state(net, cut)) | set(server_state(net, cut)) == {
            k for k in net.state_dict() if k.startswith("blocks.")
        }


@pytest.fixture
def tmp_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A unique importable module name and the file to write it to; unloaded afterwards."""
    name = f"byo_{uuid.uuid4().hex[:10]}"
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, tmp_path / f"{name}.py"
    sys.modules.pop(name, None)


# --- the three return forms -------------------------------------------------------------------


def test_block_list_factory_cuts_at_every_boundary() -> None:
    net = load_factory(SPEC.format("blocks_factory"), input_shape=SHAPE, num_classes=5, hidden=7)
    assert net.block_names == ("features", "pool", "hidden", "out")
    assert net.cuts == ("features", "pool", "hidden")
    assert net.cut_shape("hidden") == (7,)  # the caller's option reached the factory
    assert net(torch.zeros(2, *SHAPE)).shape == (2, 5)
    assert "blocks.0.0.weight" in net.state_dict()
    assert_split_is_exact(net)


def test_module_factory_splits_children_at_the_named_cuts() -> None:
    net = load_factory(SPEC.format("module_factory"), input_shape=SHAPE, num_classes=3)
    assert net.cuts == ("relu", "flatten", "fc1")
    assert net.block_names == ("relu", "flatten", "fc1", "fc2")
    assert net.cut_shape("relu") == (4, 8, 8)
    assert net.cut_shape("flatten") == (64,)
    names = set(net.state_dict())
    assert {"blocks.0.conv.weight", "blocks.0.bn.running_mean", "blocks.3.fc2.bias"} <= names
    assert_split_is_exact(net)


def test_split_module_preserves_the_original_forward() -> None:
    original = Net(4)
    original.eval()
    x = torch.randn(3, *SHAPE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = original(x)
    net = split_module(original, ["bn", "fc1"], input_shape=SHAPE, num_classes=4)
    assert not original.training  # the composition check restored the flags
    with torch.no_grad():
        assert torch.equal(net.eval()(x), expected)
    # The blocks are the original children, not copies.
    assert net.blocks[0].conv is original.conv


def test_split_net_factory_is_used_as_is() -> None:
    net = load_factory(SPEC.format("split_net_factory"), input_shape=SHAPE, num_classes=6)
    assert isinstance(net, SplitNet) and net.num_classes == 6


def test_build_model_accepts_a_factory_spec() -> None:
    net = build_model(
        SPEC.format("module_factory"), num_classes=2, in_channels=1, input_size=8, head_pool=1
    )
    assert net.cuts == ("relu", "flatten", "fc1")
    assert net(torch.zeros(2, *SHAPE)).shape == (2, 2)
    head = net.head("relu")
    assert sum(p.numel() for p in head.parameters()) == 4 * 2 + 2  # pooled to 1x1
    with pytest.raises(ModelSpecError, match="needs in_channels and input_size"):
        build_model(SPEC.format("module_factory"), num_classes=2)


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon_here", "must look like 'package.module:factory'"),
        (":factory", "must look like"),
        (f"{__name__}:", "must look like"),
        (
            "surely_not_a_module_xyz:factory",
            "cannot import module 'surely_not_a_module_xyz'.*every role.*PYTHONPATH=.*"
            "surely_not_a_module_xyz.py:factory.*sys.path starts with",
        ),
        ("no/such/file.py:factory", "model file 'no/such/file.py' .* not found"),
        (
            SPEC.format("no_such_factory"),
            r"has no attribute 'no_such_factory'.*callables are \[.*'blocks_factory'",
        ),
        (SPEC.format("NOT_CALLABLE"), "names a int, not a callable"),
        (SPEC.format("failing_factory"), "failed: RuntimeError\\('out of coffee'\\)"),
        (SPEC.format("bare_module_factory"), "returned Net; expected a sequence"),
        (SPEC.format("residual_factory"), "the input 'x' is used after the cut 'relu'"),
        (SPEC.format("own_parameter_factory"), r"never uses \['scale'\]"),
        (SPEC.format("fixed_split_net_factory"), "asked for .* and 3"),
    ],
)
def test_bad_specs_raise_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        load_factory(spec, input_shape=SHAPE, num_classes=3)


def test_unknown_factory_option_is_refused_before_calling() -> None:
    with pytest.raises(ModelSpecError, match="does not accept options"):
        load_factory(SPEC.format("blocks_factory"), input_shape=SHAPE, num_classes=3, depth=2)


def test_module_raising_on_import_is_wrapped(tmp_module: tuple[str, Path]) -> None:
    name, path = tmp_module
    path.write_text("raise ValueError('broken at import')\n")
    with pytest.raises(ModelSpecError, match=f"importing '{name}'.*broken at import"):
        load_factory(f"{name}:factory", input_shape=SHAPE, num_classes=3)


def test_a_missing_dependency_is_not_taken_for_a_missing_module(
    tmp_module: tuple[str, Path],
) -> None:
    name, path = tmp_module
    path.write_text("import surely_missing_dependency_xyz\n")
    with pytest.raises(ModelSpecError, match="ModuleNotFoundError") as info:
        load_factory(f"{name}:factory", input_shape=SHAPE, num_classes=3)
    assert "PYTHONPATH" not in str(info.value)


def test_a_file_spec_loads_the_file_once_without_touching_sys_path(tmp_path: Path) -> None:
    path = tmp_path / "my_model.py"
    path.write_text(
        "from torch import nn\n"
        "BUILDS = []\n"
        "def mlp(num_classes):\n"
        "    BUILDS.append(num_classes)\n"
        "    return [('a', nn.Flatten()), ('b', nn.Linear(64, num_classes))]\n"
    )
    before = list(sys.path)
    spec = f"{path}:mlp"
    first = load_factory(spec, input_shape=SHAPE, num_classes=3)
    second = load_factory(spec, input_shape=SHAPE, num_classes=4)
    assert first.num_classes == 3 and second.num_classes == 4
    assert sys.path == before
    (module,) = [m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path)]
    assert module.BUILDS == [3, 4]  # one module, run once, used twice


def test_a_module_whose_forward_flattens_splits_through_fx() -> None:
    net = load_factory(SPEC.format("flattens_factory"), input_shape=SHAPE, num_classes=3)
    assert net.block_names == ("relu", "fc2") and net.cut_shape("relu") == (4, 8, 8)
    assert_split_is_exact(net)


def test_factory_in_a_separate_module(tmp_module: tuple[str, Path]) -> None:
    name, path = tmp_module
    path.write_text(
        "from torch import nn\n"
        "class Builders:\n"
        "    @staticmethod\n"
        "    def mlp(num_classes):\n"
        "        return [('a', nn.Flatten()), ('b', nn.Linear(64, num_classes))]\n"
    )
    net = load_factory(f"{name}:Builders.mlp", input_shape=SHAPE, num_classes=3)
    assert net.cuts == ("a",) and net.cut_shape("a") == (64,)


@pytest.mark.parametrize(
    ("cut_after", "message"),
    [
        (["nope"], "'nope' is not a submodule of Net"),
        (["fc1", "relu"], r"in call order: \['relu', 'fc1'\]"),
        (["relu", "relu"], "must be distinct"),
        ([], "non-empty list"),
        (["fc2"], "cannot cut after 'fc2'"),
        ("relu", "non-empty list of module names, got 'relu'"),
    ],
)
def test_split_module_rejects_bad_cut_lists(cut_after: list[str], message: str) -> None:
    with pytest.raises(ModelSpecError, match=message):
        split_module(Net(3), cut_after, input_shape=SHAPE, num_classes=3)
