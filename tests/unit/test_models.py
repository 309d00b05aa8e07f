"""Built-in split models: the split is exact (forward and gradients), shapes and names line up,
and parameter counts are the ones the architectures imply."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import ModelSpecError
from models.parts import ServerModel
from models.registry import MODEL_NAMES, build_model
from models.split import SplitNet
from models.state import client_state, head_state, server_state

BATCH = 2
EXPECTED_CUTS = {
    "cnn5": ("block1", "block2", "block3"),
    "lenet5": ("block1", "block2", "block3", "block4"),
    "vgg_small": ("stage1", "stage2", "stage3", "fc1"),
    "vgg_mini": ("stage1", "stage2", "stage3", "stage4", "fc1"),
    "resnet18": ("stem", "layer1", "layer2", "layer3", "layer4"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """The CI box has two cores shared with other suites; oversubscribing them is slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def nets() -> dict[str, SplitNet]:
    """One instance of each built-in model, shared by the tests that only read weights.

    ResNet-18 gets 16x16 inputs: the same layers and parameters as at 32x32 (global pooling
    makes it resolution-independent) and a quarter of the compute; 32x32 is checked below.
    """
    torch.manual_seed(0)
    return {
        name: build_model(name, input_size=16) if name == "resnet18" else build_model(name)
        for name in MODEL_NAMES
    }


def batch(net: SplitNet, seed: int = 1) -> tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((BATCH, *net.input_shape), generator=gen)
    y = torch.randint(0, net.num_classes, (BATCH,), generator=gen)
    return x, y


def test_registry_lists_the_built_in_models() -> None:
    assert set(MODEL_NAMES) == set(EXPECTED_CUTS)


@pytest.mark.parametrize("name", sorted(EXPECTED_CUTS))
def test_cut_shapes_and_head_outputs(nets: dict[str, SplitNet], name: str) -> None:
    net = nets[name]
    assert net.cuts == EXPECTED_CUTS[name]
    x, _ = batch(net)
    net.eval()
    with torch.no_grad():
        assert net(x).shape == (BATCH, net.num_classes)
        for cut in net.cuts:
            z = net.client_blocks(cut)(x)
            assert tuple(z.shape[1:]) == net.cut_shape(cut), cut
            assert net.head(cut)(z).shape == (BATCH, net.num_classes), cut


@pytest.mark.parametrize("name", sorted(EXPECTED_CUTS))
@pytest.mark.parametrize("training", [True, False])
def test_client_then_server_equals_full_forward(
    nets: dict[str, SplitNet], name: str, training: bool
) -> None:
    net = nets[name]
    net.train(training)
    x, _ = batch(net)
    with torch.no_grad():
        full = net(x)
        for cut in net.cuts:
            split = ServerModel(net, cut)(net.client_blocks(cut)(x))
            assert torch.equal(split, full), cut
            assert torch.equal(net.server_blocks(cut)(net.client_blocks(cut)(x)), full), cut


@pytest.mark.parametrize("name", sorted(EXPECTED_CUTS))
def test_gradient_through_the_split_equals_full_gradient(
    nets: dict[str, SplitNet], name: str
) -> None:
    net = nets[name]
    net.train()
    x, y = batch(net)

    net.zero_grad()
    F.cross_entropy(net(x), y).backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    assert set(expected) == {n for n, _ in net.named_parameters() if n.startswith("blocks.")}

    for cut in net.cuts:
        net.zero_grad()
        client, server = net.client_blocks(cut), ServerModel(net, cut)
        z = client(x)
        # What crosses the wire: a detached copy of z; the server returns dL/dz.
        z_server = z.detach().requires_grad_()
        F.cross_entropy(server(z_server), y).backward()
        assert z_server.grad is not None
        z.backward(z_server.grad)
        got = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
        assert set(got) == set(expected), cut
        for n, grad in expected.items():
            torch.testing.assert_close(got[n], grad, rtol=1e-5, atol=1e-6, msg=f"{cut}: {n}")


@pytest.mark.parametrize("name", sorted(EXPECTED_CUTS))
def test_client_and_server_state_partition_the_state_dict(
    nets: dict[str, SplitNet], name: str
) -> None:
    net = nets[name]
    full = net.state_dict()
    blocks = {k for k in full if k.startswith("blocks.")}
    heads = {k for k in full if k.startswith("heads.")}
    assert blocks | heads == set(full)
    assert set(head_state(net, net.cuts)) == heads
    for cut in net.cuts:
        client, server = client_state(net, cut), server_state(net, cut)
        assert not set(client) & set(server), cut
        assert set(client) | set(server) == blocks, cut

        later = net.cuts[net.cuts.index(cut) + 1 :]
        server_h = {**server, **head_state(net, later)}
        for k, t in {**client, **server_h}.items():
            assert torch.equal(t, full[k]), k
        # BatchNorm running stats travel with their layer.
        assert any(k.endswith("running_mean") for k in client), cut

        assert set(ServerModel(net, cut).state_dict()) == set(server_h), cut


@pytest.mark.parametrize("name", sorted(EXPECTED_CUTS))
def test_server_heads_match_heads_on_cut_activations(nets: dict[str, SplitNet], name: str) -> None:
    net = nets[name]
    net.eval()
    x, _ = batch(net)
    with torch.no_grad():
        logits = net(x)
        cut = net.cuts[0]  # FedSplitX: server heads are those of the later cuts
        server_out, server_aux = ServerModel(net, cut).forward_from(net.client_blocks(cut)(x), cut)
        assert set(server_aux) == set(net.cuts[1:])
        assert torch.equal(server_out, logits)
        for c, value in server_aux.items():
            assert torch.equal(value, net.head(c)(net.client_blocks(c)(x))), c


def test_depth_levels_follow_the_cut_order(nets: dict[str, SplitNet]) -> None:
    net = nets["resnet18"]
    indices = [net.cut_index(cut) for cut in net.cuts]
    assert indices == sorted(indices)
    for cut in net.cuts:
        assert net.cut_index(cut) == net.block_names.index(cut)


def test_resnet18_cut_shapes_at_cifar_resolution() -> None:
    net = build_model("resnet18")
    assert net.input_shape == (3, 32, 32)
    assert [net.cut_shape(c) for c in net.cuts] == [
        (64, 32, 32),
        (64, 32, 32),
        (128, 16, 16),
        (256, 8, 8),
        (512, 4, 4),
    ]


def test_unknown_cut_is_a_clear_error(nets: dict[str, SplitNet]) -> None:
    net = nets["cnn5"]
    for call in (net.cut_index, net.cut_shape, net.head, net.client_blocks, net.server_blocks):
        with pytest.raises(ModelSpecError, match=r"unknown cut 'nope'.*block1"):
            call("nope")
    with pytest.raises(ModelSpecError, match="unknown cut"):
        ServerModel(net, "classifier")  # the last block is not a cut


def test_server_replica_is_independent_after_deepcopy() -> None:
    net = build_model("cnn5")
    replica = copy.deepcopy(ServerModel(net, "block2"))
    with torch.no_grad():
        for p in replica.parameters():
            p.add_(1.0)
    originals = dict(net.named_parameters())
    for name, value in replica.named_parameters():
        assert not torch.equal(value, originals[name]), name
    assert set(dict(replica.named_parameters())) <= set(originals)


def test_construction_leaves_batchnorm_statistics_untouched() -> None:
    net = build_model("lenet5")
    for module in net.modules():
        if isinstance(module, nn.BatchNorm2d):
            assert module.num_batches_tracked is not None
            assert int(module.num_batches_tracked) == 0
            assert module.running_mean is not None and module.running_var is not None
            assert torch.equal(module.running_mean, torch.zeros_like(module.running_mean))
            assert torch.equal(module.running_var, torch.ones_like(module.running_var))
    assert net.training


# --- parameter counts, derived from the architectures ------------------------------------------


def conv(cin: int, cout: int, k: int, bias: bool) -> int:
    return cout * cin * k * k + (cout if bias else 0)


def bn(channels: int) -> int:
    return 2 * channels  # weight and bias; running stats are buffers


def linear(fin: int, fout: int) -> int:
    return fin * fout + fout


def head(shape: tuple[int, ...], classes: int, pool: int = 2) -> int:
    if len(shape) == 3:
        return linear(shape[0] * min(pool, shape[1]) * min(pool, shape[2]), classes)
    return linear(shape[0], classes)


def block_params(net: SplitNet) -> int:
    return sum(p.numel() for p in net.blocks.parameters())


def head_params(net: SplitNet) -> int:
    return sum(p.numel() for p in net.heads.parameters())


def test_cnn5_parameter_count() -> None:
    net = build_model("cnn5")
    side = ((28 - 4) // 2 - 4) // 2  # two valid 5x5 convs, each followed by a 2x2 pool
    expected = (
        conv(1, 10, 5, True) + bn(10)
        + conv(10, 20, 5, True) + bn(20)
        + linear(20 * side * side, 50)
        + linear(50, 10)
    )  # fmt: skip
    assert block_params(net) == expected
    assert 21_800 <= expected <= 21_950  # the "about 21.8k" of the Sub-FedAvg CNN, plus BN
    assert head_params(net) == sum(head(net.cut_shape(c), 10) for c in net.cuts)


def test_lenet5_parameter_count() -> None:
    net = build_model("lenet5")
    side = ((32 - 4) // 2 - 4) // 2
    expected = (
        conv(3, 6, 5, True) + bn(6)
        + conv(6, 16, 5, True) + bn(16)
        + linear(16 * side * side, 120) + linear(120, 84) + linear(84, 10)
    )  # fmt: skip
    assert block_params(net) == expected


def test_vgg_small_parameter_count() -> None:
    net = build_model("vgg_small", in_channels=1, input_size=28)
    widths = [1, 32, 32, 64, 64, 128]
    convs = sum(conv(a, b, 3, False) + bn(b) for a, b in itertools.pairwise(widths))
    side = 28 // 2 // 2 // 2
    expected = convs + linear(128 * side * side, 256) + linear(256, 10)
    assert block_params(net) == expected
    assert net.cut_shape("stage3") == (128, side, side)


def test_vgg_mini_has_four_conv_layers_before_stage3() -> None:
    net = build_model("vgg_mini")
    client = net.client_blocks("stage3")
    convs = [m for m in client.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [c.out_channels for c in convs] == [8, 16, 32, 32]
    widths = [1, 8, 16, 32, 32, 64]
    expected = sum(conv(a, b, 3, False) + bn(b) for a, b in itertools.pairwise(widths))
    assert block_params(net) == expected + linear(64, 64) + linear(64, 10)
    assert net.cut_shape("stage3") == (32, 3, 3)


def test_resnet18_parameter_count(nets: dict[str, SplitNet]) -> None:
    net = nets["resnet18"]

    def basic(cin: int, cout: int, stride: int) -> int:
        total = conv(cin, cout, 3, False) + bn(cout) + conv(cout, cout, 3, False) + bn(cout)
        if stride != 1 or cin != cout:
            total += conv(cin, cout, 1, False) + bn(cout)
        return total

    stages = [(64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)]
    expected = conv(3, 64, 3, False) + bn(64)
    expected += sum(basic(cin, cout, s) + basic(cout, cout, 1) for cin, cout, s in stages)
    expected += linear(512, 10)
    assert block_params(net) == expected
    assert 11_100_000 < expected < 11_200_000  # the familiar 11.17M of CIFAR ResNet-18
    assert head_params(net) == sum(head(net.cut_shape(c), 10) for c in net.cuts)


# --- registry options and construction errors ---------------------------------------------------


def test_builders_adapt_to_input_shape_and_classes() -> None:
    net = build_model("cnn5", in_channels=3, input_size=32, num_classes=7)
    assert net.input_shape == (3, 32, 32)
    assert net.cut_shape("block2") == (20, 5, 5)
    assert net(torch.zeros(2, 3, 32, 32)).shape == (2, 7)

    small = build_model("resnet18", width=8, input_size=16, num_classes=5)
    assert small.cut_shape("layer4") == (64, 2, 2)
    assert small(torch.zeros(2, 3, 16, 16)).shape == (2, 5)


def test_head_pool_option_sets_the_head_size() -> None:
    net = build_model("lenet5", head_pool=1)
    head_block1 = net.head("block1")
    assert isinstance(head_block1, nn.Module)
    assert sum(p.numel() for p in head_block1.parameters()) == linear(6, 10)
    with pytest.raises(ModelSpecError, match="not both"):
        build_model("lenet5", head_pool=1, head_factory=lambda s, n: nn.Linear(s[0], n))


def test_custom_head_factory_gets_cut_shape_and_classes() -> None:
    seen: list[tuple[tuple[int, ...], int]] = []

    def factory(shape: tuple[int, ...], classes: int) -> nn.Module:
        seen.append((shape, classes))
        return nn.Sequential(nn.Flatten(), nn.Linear(int(torch.Size(shape).numel()), classes))

    net = build_model("cnn5", num_classes=4, head_factory=factory)
    assert seen == [(net.cut_shape(c), 4) for c in net.cuts]


def test_registry_errors() -> None:
    with pytest.raises(ModelSpecError, match=r"unknown model 'resnet50'.*cnn5"):
        build_model("resnet50")
    with pytest.raises(ModelSpecError, match=r"no options \['depth'\]; its options are none"):
        build_model("cnn5", depth=3)
    with pytest.raises(
        ModelSpecError, match=r"no options \['depth'\]; its options are \['width'\]"
    ):
        build_model("resnet18", depth=3)
    with pytest.raises(ModelSpecError, match="failed"):
        build_model("cnn5", input_size=8)  # too small for two 5x5 convs and two pools


def two_blocks(
    first: str = "a", second: str = "b", classes: int = 3
) -> list[tuple[str, nn.Module]]:
    return [(first, nn.Sequential(nn.Flatten(), nn.Linear(4, 5))), (second, nn.Linear(5, classes))]


def test_split_net_validates_its_layout() -> None:
    net = SplitNet(two_blocks(), input_shape=(4,), num_classes=3)
    assert net.cuts == ("a",) and net.cut_shape("a") == (5,)
    cases: list[tuple[dict[str, object], str]] = [
        ({"blocks": two_blocks()[:1]}, "at least 2 blocks"),
        ({"blocks": two_blocks("a", "a")}, "duplicate block names"),
        ({"blocks": two_blocks("a.b")}, "not usable"),
        ({"blocks": two_blocks("keys")}, "not usable"),
        ({"cuts": ("b",)}, "last block"),
        ({"cuts": ("z",)}, "not a block name"),
        ({"cuts": ()}, "at least one cut"),
        ({"num_classes": 4}, r"outputs shape \(3,\).*num_classes=4"),
        ({"input_shape": (6,)}, "failed"),
    ]
    for override, message in cases:
        kwargs: dict[str, object] = {"blocks": two_blocks(), "input_shape": (4,), "num_classes": 3}
        kwargs.update(override)
        with pytest.raises(ModelSpecError, match=message):
            SplitNet(**kwargs)  # type: ignore[arg-type]


class NeedsValues(nn.Module):
    """A block whose forward branches on a value (no symbolic shape tracing would do)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.bn(self.fc(x))
        return out * 2 if float(out.abs().sum()) >= 0 else out


def test_shape_inference_handles_value_dependent_blocks_without_side_effects() -> None:
    block = NeedsValues()
    net = SplitNet([("probe", block), ("out", nn.Linear(4, 2))], input_shape=(4,), num_classes=2)
    assert net.cut_shape("probe") == (4,)
    assert net.training and block.bn.training  # training flags restored
    assert block.bn.num_batches_tracked is not None
    assert int(block.bn.num_batches_tracked) == 0
