"""Defences on smashed data (services/algorithms/defences.py): each function on hand-computed
cases, the defended split step's gradient against autograd of the whole defended model, and
the `[privacy]` settings from the file to the client's strategy."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from models.registry import build_model
from models.split import SplitNet
from models.state import client_state
from services.algorithms.base import ClientContext, Hyper, LocalRound, Tally
from services.algorithms.defences import (
    Defences,
    add_noise,
    clip_rows,
    defend,
    distance_correlation,
    nopeek_loss,
)
from services.algorithms.registry import build_strategy
from services.client.plan import RoundPlan
from services.common.handout import client_config
from services.config.loading import ConfigError, load_settings
from services.config.root import Settings
from tests.unit.test_client_peers import max_diff

CUT = "block1"

# --- distance correlation ------------------------------------------------------------------


def reference_dcor(x: list[list[float]], z: list[list[float]]) -> float:
    """Szekely et al.'s V-statistic by its definition, in plain Python."""
    n = len(x)

    def centred(rows: list[list[float]]) -> list[list[float]]:
        d = [
            [sum((a - b) ** 2 for a, b in zip(p, q, strict=True)) ** 0.5 for q in rows]
            for p in rows
        ]
        row = [sum(r) / n for r in d]
        col = [sum(d[j][k] for j in range(n)) / n for k in range(n)]
        grand = sum(row) / n
        return [[d[j][k] - row[j] - col[k] + grand for k in range(n)] for j in range(n)]

    a, b = centred(x), centred(z)
    pairs = list(itertools.product(range(n), repeat=2))
    dcov = sum(a[j][k] * b[j][k] for j, k in pairs) / n**2
    dvx = sum(a[j][k] ** 2 for j, k in pairs) / n**2
    dvz = sum(b[j][k] ** 2 for j, k in pairs) / n**2
    return float((dcov / (dvx * dvz) ** 0.5) ** 0.5)


def test_dcor_of_identical_and_of_affinely_related_batches_is_one() -> None:
    x = torch.randn(16, 3, 5, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert float(distance_correlation(x, x)) == pytest.approx(1.0, abs=1e-12)
    # Distances scale by 2 under 2x + 3: dCor is invariant to it.
    assert float(distance_correlation(x, 2 * x.flatten(1) + 3)) == pytest.approx(1.0, abs=1e-12)


def test_dcor_of_an_independent_product_sample_is_zero() -> None:
    # The empirical joint of (0,0), (0,1), (1,0), (1,1) is the product of its marginals: the
    # V-statistic dCov_n is exactly 0, whatever the batch's other structure.
    x = torch.tensor([[0.0], [0.0], [1.0], [1.0]], dtype=torch.float64)
    z = torch.tensor([[0.0], [1.0], [0.0], [1.0]], dtype=torch.float64)
    assert float(distance_correlation(x, z)) == pytest.approx(0.0, abs=1e-7)


def test_dcor_matches_a_hand_computed_case_and_the_definition() -> None:
    # x = (0, 1, 2), z = (0, 2, 1): row means of a (1, 2/3, 1), of b (1, 1, 2/3), both grand
    # means 8/9; A = [[-10,2,8],[2,-4,2],[8,2,-10]]/9, B = [[-10,8,2],[8,-10,2],[2,2,-4]]/9;
    # 81 sum AB = 252, 81 sum A^2 = 81 sum B^2 = 360: dCor^2 = 252/360 = 0.7.
    x, z = [[0.0], [1.0], [2.0]], [[0.0], [2.0], [1.0]]
    hand = 0.7**0.5
    assert reference_dcor(x, z) == pytest.approx(hand, rel=1e-12)
    got = distance_correlation(
        torch.tensor(x, dtype=torch.float64), torch.tensor(z, dtype=torch.float64)
    )
    assert float(got) == pytest.approx(hand, rel=1e-12)
    g = torch.Generator().manual_seed(1)
    xs, zs = torch.randn(7, 4, generator=g), torch.randn(7, 3, generator=g)
    want = reference_dcor(xs.tolist(), zs.tolist())
    assert float(distance_correlation(xs.double(), zs.double())) == pytest.approx(want, rel=1e-9)


def test_dcor_without_spread_is_zero_and_batches_must_match() -> None:
    x = torch.randn(5, 3)
    assert float(distance_correlation(x, torch.ones(5, 2))) == 0.0
    assert float(distance_correlation(x[:1], x[:1])) == 0.0
    with pytest.raises(ValueError, match="same batch size"):
        distance_correlation(x, x[:4])


def test_dcor_and_clip_gradients_match_finite_differences() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g)
    z = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: distance_correlation(x, t), (z,))
    # Rows inside and outside the ball (norms of ~2 around the bound 2).
    assert torch.autograd.gradcheck(lambda t: clip_rows(t, 2.0), (z,))
    assert torch.autograd.gradcheck(lambda t: nopeek_loss(x, clip_rows(t, 2.0), 0.3), (z,))


# --- clipping and noise --------------------------------------------------------------------


def test_clipping_bounds_each_sample_norm_and_leaves_small_ones() -> None:
    z = torch.tensor([[[3.0, 4.0]], [[0.3, 0.4]], [[0.0, 0.0]]], requires_grad=True)
    out = clip_rows(z, 1.0)
    assert out.shape == z.shape
    assert torch.allclose(out[0], torch.tensor([[0.6, 0.8]]))
    assert torch.equal(out[1], z[1]) and torch.equal(out[2], z[2])
    out.sum().backward()
    assert z.grad is not None and torch.isfinite(z.grad).all()
    # Inside the ball the clip is the identity, gradient included.
    assert torch.equal(z.grad[1], torch.ones(1, 2)) and torch.equal(z.grad[2], torch.ones(1, 2))


def test_noise_has_the_configured_statistics_and_is_seeded() -> None:
    d = Defences(noise_scale=0.5, seed=7)
    z = torch.zeros(200, 500)
    cpu = torch.device("cpu")
    noise = add_noise(z, 0.5, d.generator(cpu, "client-1", 3, 4))
    assert abs(float(noise.mean())) < 0.005  # 1e5 draws: the mean's sd is 0.0016
    assert float(noise.std()) == pytest.approx(0.5, rel=0.01)
    again = add_noise(z, 0.5, d.generator(cpu, "client-1", 3, 4))
    assert torch.equal(noise, again)
    for other in (d.generator(cpu, "client-1", 3, 5), d.generator(cpu, "client-2", 3, 4)):
        assert not torch.equal(noise, add_noise(z, 0.5, other))
    assert not torch.equal(
        noise, add_noise(z, 0.5, Defences(seed=8).generator(cpu, "client-1", 3, 4))
    )
    with pytest.raises(ValueError, match="generator"):
        add_noise(z, 0.5, None)


def test_defend_clips_before_the_noise() -> None:
    z = torch.tensor([[30.0, 40.0]])
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    out = defend(z, 0.1, 5.0, g1)
    want = torch.tensor([[3.0, 4.0]]) + 0.1 * torch.randn((1, 2), generator=g2)
    assert torch.allclose(out, want)
    assert defend(z, 0.0, None, None) is z


def test_no_defence_returns_z_itself() -> None:
    z = torch.randn(4, 3, requires_grad=True)
    smashed = Defences().apply(torch.randn(4, 2), z)
    assert smashed.sent is z and smashed.penalty is None
    loss = z.sum()
    assert smashed.with_penalty(loss) is loss
    assert build_strategy("sfl_v2").defences == Defences()


# --- the split step's gradient ------------------------------------------------------------


class ServerChannel:
    """A worker in-process: the server part's loss on what the client sent, dL/dz' back."""

    def __init__(self, server: nn.Module) -> None:
        self.server = server
        self.sent: list[torch.Tensor] = []

    @property
    def tally(self) -> Tally:
        raise AssertionError("not used")

    def exchange(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.sent.append(z.clone())
        z = z.detach().requires_grad_(True)
        F.cross_entropy(self.server(z), y).backward()
        assert z.grad is not None
        return z.grad

    def send(self, z: torch.Tensor, y: torch.Tensor, step: int, steps: int) -> None:
        raise AssertionError("not used")


def client_step(
    params: dict[str, object], x: torch.Tensor, y: torch.Tensor
) -> tuple[SplitNet, ServerChannel]:
    """One SFL-V2 client step from the seeded cnn5 with a server part in-process."""
    model = seeded_cnn5()
    channel = ServerChannel(model.server_blocks(CUT))
    r = LocalRound(model, CUT, [(x, y)], 1, channel, Hyper(lr=0.1), ClientContext("c", 2))
    build_strategy("sfl_v2", params).client_round(r)
    return model, channel


def seeded_cnn5() -> SplitNet:
    torch.manual_seed(0)
    return build_model("cnn5")


def test_the_defended_split_step_takes_the_gradient_of_the_defended_model() -> None:
    """SFL's client step with every defence on moves the client side exactly as SGD on
    `CE(server(z'), y) + alpha * dCor(x, z')`, z' = clip(body(x)) + noise, does in one graph."""
    params: dict[str, object] = {
        "privacy.noise_scale": 0.05,
        "privacy.clip_norm": 3.0,
        "privacy.nopeek_weight": 0.7,
        "privacy.seed": 11,
    }
    defences = build_strategy("sfl_v2", params).defences
    assert defences == Defences(0.05, 3.0, 0.7, 11)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)

    reference = seeded_cnn5()
    body, server = reference.client_blocks(CUT), reference.server_blocks(CUT)
    sent = defend(body(x), 0.05, 3.0, defences.generator(torch.device("cpu"), "c", 2, 0))
    (F.cross_entropy(server(sent), y) + 0.7 * distance_correlation(x, sent)).backward()
    torch.optim.SGD(body.parameters(), lr=0.1).step()

    model, channel = client_step(params, x, y)
    assert torch.allclose(channel.sent[0], sent.detach(), atol=1e-6)
    assert max_diff(client_state(model, CUT), client_state(reference, CUT)) <= 1e-6
    # Each defence changes the step: without the penalty, or without the clip, it differs.
    for off in ({"privacy.nopeek_weight": 0.0}, {"privacy.clip_norm": 1e9}):
        other, _ = client_step({**params, **off}, x, y)
        assert max_diff(client_state(other, CUT), client_state(model, CUT)) > 1e-5


class UChannel:
    """A U-shaped worker in-process: the server's blocks forward, then dL/dz' from the tail's
    gradient."""

    def __init__(self, server: nn.Module) -> None:
        self.server = server
        self.sent: list[torch.Tensor] = []
        self.open: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, z: torch.Tensor, step: int, steps: int) -> torch.Tensor:
        self.sent.append(z.clone())
        z = z.detach().requires_grad_(True)
        out = self.server(z)
        self.open = (z, out)
        return out.detach()

    def backward(self, grad: torch.Tensor) -> torch.Tensor:
        assert self.open is not None
        z, out = self.open
        out.backward(grad)
        assert z.grad is not None
        return z.grad


def test_a_u_shaped_client_step_is_defended_too() -> None:
    params: dict[str, object] = {
        "privacy.noise_scale": 0.05,
        "privacy.clip_norm": 3.0,
        "privacy.nopeek_weight": 0.7,
    }
    defences = build_strategy("sfl_v2", params).defences
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(8, 1, 28, 28, generator=g), torch.randint(0, 10, (8,), generator=g)

    reference = seeded_cnn5()
    reference.set_tail("block3", CUT)
    body, tail = reference.client_blocks(CUT), reference.tail_blocks()
    sent = defend(body(x), 0.05, 3.0, defences.generator(torch.device("cpu"), "c", 2, 0))
    logits = tail(reference.server_blocks(CUT)(sent))
    (F.cross_entropy(logits, y) + 0.7 * distance_correlation(x, sent)).backward()
    torch.optim.SGD([*body.parameters(), *tail.parameters()], lr=0.1).step()

    model = seeded_cnn5()
    model.set_tail("block3", CUT)
    channel = UChannel(model.server_blocks(CUT))
    r = LocalRound(model, CUT, [(x, y)], 1, channel, Hyper(lr=0.1), ClientContext("c", 2))  # type: ignore[arg-type]
    build_strategy("sfl_v2", params).client_round(r)
    assert torch.allclose(channel.sent[0], sent.detach(), atol=1e-6)
    assert max_diff(client_state(model, CUT), client_state(reference, CUT)) <= 1e-6


# --- settings ------------------------------------------------------------------------------


def write(tmp_path: Path, privacy: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(f"[privacy]\n{privacy}\n")
    return path


@pytest.mark.parametrize(
    ("line", "setting", "message"),
    [
        ("noise_scale = -0.1", "privacy.noise_scale", "greater than or equal to 0"),
        ("noise_scale = inf", "privacy.noise_scale", "finite number"),
        ("clip_norm = 0", "privacy.clip_norm", "greater than 0"),
        ("clip_norm = -2.0", "privacy.clip_norm", "greater than 0"),
        ("nopeek_weight = -1", "privacy.nopeek_weight", "greater than or equal to 0"),
        ("noise = 1.0", "privacy.noise", "Extra inputs are not permitted"),
    ],
)
def test_bad_privacy_settings_are_errors_naming_the_setting(
    tmp_path: Path, line: str, setting: str, message: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(write(tmp_path, line), {})
    assert f"{setting}: " in str(caught.value) and message in str(caught.value)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"privacy.noise_scale": -1.0}, "privacy.noise_scale must be a finite number >= 0"),
        ({"privacy.clip_norm": 0.0}, "privacy.clip_norm must be a finite number > 0"),
        ({"privacy.nopeek_weight": float("nan")}, "privacy.nopeek_weight must be a finite"),
        ({"privacy.noise_scale": "big"}, "privacy.noise_scale must be a number"),
        ({"privacy.seed": 1.5}, "privacy.seed must be an integer"),
        ({"privacy.sigma": 1.0}, "unknown privacy setting"),
    ],
)
def test_a_client_refuses_bad_privacy_parameters(params: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_strategy("sfl_v2", params)


def test_privacy_settings_reach_the_clients_strategy(tmp_path: Path) -> None:
    off = load_settings(None, {})
    # Off: the config a client gets is as it was before the defences existed.
    assert not any("privacy" in key for key in client_config(off, 0))
    settings = load_settings(write(tmp_path, "noise_scale = 0.5\nclip_norm = 2.0\n"), {})
    settings = Settings.model_validate({**settings.model_dump(), "job": {"seed": 5}})
    config = client_config(settings, 0)
    assert config["params.privacy.noise_scale"] == 0.5 and config["params.privacy.seed"] == 5
    assert "params.privacy.nopeek_weight" in config
    plan = RoundPlan.from_settings(off).updated(config)
    strategy = build_strategy(plan.algorithm, plan.params)
    assert strategy.defences == Defences(noise_scale=0.5, clip_norm=2.0, seed=5)
    # An algorithm with its own section keeps it beside the defences.
    assert build_strategy("splitgp", {"gamma": 0.3, **dict(plan.params)}).defences.active
