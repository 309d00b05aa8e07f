"""The privacy attacks and the in-process split loops they run on (services.privacy)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from models.errors import ModelSpecError
from models.registry import build_model
from models.split import SplitNet
from services.algorithms.base import Hyper
from services.algorithms.defences import distance_correlation
from services.config.root import Settings
from services.data.loaders import load_dataset
from services.privacy.inversion import DecoderTraining
from services.privacy.labels import LabelLeakMeter, cosine_scores, norm_scores
from services.privacy.loop import ClientHooks, SplitParts, SplitTrainer
from services.privacy.metrics import roc_auc, ssim
from services.privacy.sweep import Budget, Case, CaseResult, binary_task, run_case


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_auc_of_separated_reversed_tied_and_random_scores() -> None:
    positive = torch.tensor([True, True, False, False, False])
    assert roc_auc(torch.tensor([5.0, 4, 3, 2, 1]), positive) == 1.0
    assert roc_auc(torch.tensor([1.0, 2, 3, 4, 5]), positive) == 0.0
    assert roc_auc(torch.ones(5), positive) == 0.5
    labels = torch.rand(4000, generator=_generator()) < 0.2
    assert roc_auc(torch.rand(4000, generator=_generator(1)), labels) == pytest.approx(
        0.5, abs=0.03
    )


def test_norm_and_cosine_attacks_recover_labels_from_separable_gradients() -> None:
    gen = _generator()
    n, dim = 1000, 50
    y = (torch.rand(n, generator=gen) < 0.1).long()  # rare positives, as in Li et al.
    direction = torch.randn(dim, generator=gen)
    # Positives: larger and pointing along +direction; negatives: smaller, along -direction.
    scale = torch.where(y == 1, 3.0, 1.0)[:, None]
    sign = torch.where(y == 1, 1.0, -1.0)[:, None]
    grads = scale * (sign * direction + 0.1 * torch.randn(n, dim, generator=gen))
    assert roc_auc(norm_scores(grads), y == 1) == 1.0
    reference = grads[(y == 1).nonzero()[0, 0]]
    assert roc_auc(cosine_scores(grads, reference), y == 1) > 0.999
    meter = LabelLeakMeter(num_classes=2)
    meter.add(grads, y)
    assert meter.aucs()["norm"] == 1.0
    assert meter.aucs()["cosine"] == 1.0


def test_attacks_are_chance_on_gradients_unrelated_to_the_labels() -> None:
    gen = _generator(2)
    y = torch.randint(0, 10, (3000,), generator=gen)
    meter = LabelLeakMeter(num_classes=10)
    for rows in torch.randn(3000, 20, generator=gen).split(100):
        meter.add(rows, y[: len(rows)])
        y = y[len(rows) :] if len(y) > len(rows) else y
    aucs = meter.aucs()
    assert aucs["norm"] == pytest.approx(0.5, abs=0.05)
    assert aucs["cosine"] == pytest.approx(0.5, abs=0.05)


def test_cosine_attack_separates_ten_classes_from_softmax_tail_gradients() -> None:
    # dL/dh of a linear softmax tail is W^T (p - onehot(y)): the class shows in the direction.
    gen = _generator(3)
    weight = torch.randn(10, 50, generator=gen)
    y = torch.randint(0, 10, (640,), generator=gen)
    p = torch.softmax(0.3 * torch.randn(640, 10, generator=gen), dim=1)
    grads = (p - F.one_hot(y, 10).float()) @ weight
    meter = LabelLeakMeter(num_classes=10)
    for g, labels in zip(grads.split(64), y.split(64), strict=True):
        meter.add(g, labels)
    assert meter.aucs()["cosine"] > 0.95


def test_distance_correlation_of_independent_and_dependent_data() -> None:
    gen = _generator(4)
    x = torch.randn(500, 2, generator=gen)
    # The service's dCor (NoPeek's), which the evaluation reports too.
    assert float(distance_correlation(x, torch.randn(500, 2, generator=gen))) < 0.2
    rotation, _ = torch.linalg.qr(torch.randn(2, 2, generator=gen))
    assert float(distance_correlation(x, 3 * x @ rotation + 1)) == pytest.approx(1.0, abs=1e-5)
    assert float(distance_correlation(x, x**2)) > 0.3  # dependent though uncorrelated
    with pytest.raises(ValueError, match="same batch size"):
        distance_correlation(x, x[:10])


def test_ssim_of_an_image_with_itself_is_one_and_with_noise_less() -> None:
    image = torch.rand(2, 1, 28, 28, generator=_generator(5))
    assert torch.allclose(ssim(image, image), torch.ones(2))
    assert bool((ssim(image, torch.rand(2, 1, 28, 28, generator=_generator(6))) < 0.2).all())


def _cnn5() -> SplitNet:
    torch.manual_seed(0)
    return build_model("cnn5", num_classes=10, in_channels=1, input_size=28)


def test_ushaped_and_plain_steps_equal_whole_model_backprop() -> None:
    hyper = Hyper(lr=0.05, momentum=0.9)
    reference = _cnn5()
    nets = {"plain": copy.deepcopy(reference), "ushaped": copy.deepcopy(reference)}
    trainers = {
        mode: SplitTrainer(
            SplitParts.of(net, "block1", ushaped=mode == "ushaped"), hyper, ClientHooks()
        )
        for mode, net in nets.items()
    }
    whole = hyper.client_optimizer(reference.parameters())
    gen = _generator(7)
    for _ in range(3):
        x, y = torch.randn(16, 1, 28, 28, generator=gen), torch.randint(0, 10, (16,), generator=gen)
        for trainer in trainers.values():
            trainer.step(x, y)
        whole.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        whole.step()
    expected = reference.state_dict()
    for net in nets.values():
        for name, tensor in net.state_dict().items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)


def test_defence_hooks_change_what_is_sent() -> None:
    net = _cnn5()
    parts = SplitParts.of(net, "block2", ushaped=True)
    seen: list[tuple[torch.Size, torch.Size]] = []

    def regulariser(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        seen.append((x.shape, z.shape))
        return z.sum() * 0

    defences = ClientHooks(gradient=lambda g: torch.zeros_like(g), regulariser=regulariser)
    server_before = copy.deepcopy(parts.server.state_dict())
    record = SplitTrainer(parts, Hyper(lr=0.1), defences).step(
        torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    )
    assert record.sent_gradient is not None and not record.sent_gradient.any()
    for name, tensor in parts.server.state_dict().items():
        if tensor.is_floating_point() and "running" not in name:
            torch.testing.assert_close(tensor, server_before[name])  # a zero gradient came back
    assert seen == [(torch.Size([8, 1, 28, 28]), torch.Size([8, 20, 4, 4]))]


def test_a_ushaped_cut_must_leave_the_server_a_block() -> None:
    with pytest.raises(ModelSpecError, match="leaves the server no block"):
        SplitParts.of(_cnn5(), "block3", ushaped=True)


@pytest.fixture(scope="module")
def binary_run() -> CaseResult:
    """Li et al.'s setting, small: one Fashion-MNIST class (10%) against the rest, U-shaped,
    undefended, 60 steps on the shipped sample."""
    torch.set_num_threads(1)
    settings = Settings.model_validate(
        {
            "model": {"name": "cnn5", "num_classes": 2},
            "algorithm": {"batch_size": 64, "lr": 0.05, "momentum": 0.9},
        }
    )
    data = binary_task(load_dataset("fashion_mnist_sample"), positive=0)
    budget = Budget(
        rounds=2,
        steps_per_round=30,
        decoder=DecoderTraining(epochs=3, width=16),
        public_samples=1000,
        private_samples=200,
        dcor_samples=200,
    )
    return run_case(settings, data, Case("block1", ushaped=True), budget, lambda _: ClientHooks())


def test_label_attacks_reach_the_published_leak_in_the_binary_imbalanced_setting(
    binary_run: CaseResult,
) -> None:
    assert len(binary_run.label_auc) == 2
    last = binary_run.label_auc[-1]
    assert last["norm"] >= 0.9
    assert last["cosine"] >= 0.9
    assert binary_run.accuracy[-1] > 0.9  # above the 90% of always answering "rest"


def test_decoder_beats_the_mean_image(binary_run: CaseResult) -> None:
    recon = binary_run.reconstruction
    assert recon is not None
    assert recon.mse < 0.7 * recon.baseline_mse
    assert recon.psnr_db > recon.baseline_psnr_db
    assert recon.images.shape == (16, 1, 28, 28)
    assert 0.5 < binary_run.dcor <= 1.0
