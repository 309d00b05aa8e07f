"""One privacy evaluation per setting: train the job's model in-process with the setting's
defences, attack the labels every round (U-shaped), then reconstruct inputs and measure dCor
on the trained client body; and the same over a grid of settings."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from functools import partial
from typing import Any

import torch
from torch import Tensor

from services.algorithms.defences import add_noise, defend, distance_correlation, nopeek_loss
from services.common.jobmodel import job_hyper, job_model
from services.config.root import Settings
from services.data.loaders import Dataset, Split
from services.privacy.inversion import (
    DecoderTraining,
    Reconstruction,
    evaluate_decoder,
    train_decoder,
)
from services.privacy.labels import LabelLeakMeter, norm_scores
from services.privacy.loop import ClientHooks, SplitParts, SplitTrainer, accuracy, smashed


@dataclass(frozen=True)
class Case:
    """One setting: where the model is cut, U-shaped or not, and the client's defences."""

    cut: str
    ushaped: bool
    noise: float = 0.0
    """Standard deviation of the Gaussian noise on z."""
    clip: float = 0.0
    """Bound on each example's ||z||_2 before the noise (0: none)."""
    nopeek: float = 0.0
    """Weight of the NoPeek dCor(x, z) term in the client's loss."""
    gradient_noise: float = 0.0
    """Standard deviation of the Gaussian noise on the dL/dh a U-shaped client returns."""

    @property
    def label(self) -> str:
        parts = [self.cut, "ushaped" if self.ushaped else "plain"]
        for name in ("noise", "clip", "nopeek", "gradient_noise"):
            value = getattr(self, name)
            if value:
                parts.append(f"{name}{value:g}")
        return "-".join(parts)


@dataclass(frozen=True)
class Budget:
    """How much work one case gets."""

    rounds: int = 3
    steps_per_round: int = 100
    """Training steps per round (0: one pass over the training data)."""
    decoder: DecoderTraining = field(default_factory=DecoderTraining)
    public_samples: int = 0
    """Test images the decoder trains on (0: the whole test split)."""
    private_samples: int = 512
    """Training images reconstructed and scored."""
    dcor_samples: int = 512
    eval_batch: int = 1024


@dataclass
class CaseResult:
    case: Case
    accuracy: list[float] = field(default_factory=list)
    """Test accuracy after each round."""
    label_auc: list[dict[str, float]] = field(default_factory=list)
    """Per round, the norm and cosine attacks' AUC on that round's gradients (U-shaped)."""
    dcor: float = math.nan
    smashed_rms: float = math.nan
    """Root mean square of the undefended z over test images: the unit of `Case.noise`."""
    gradient_norm: float = math.nan
    """Mean ||dL/dh|| per example over the last round (U-shaped): the unit of `gradient_noise`
    (the loss is a batch mean, so each example's gradient carries 1/batch_size)."""
    reconstruction: Reconstruction | None = None
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        recon = self.reconstruction
        return {
            "label": self.case.label,
            "case": asdict(self.case),
            "accuracy": self.accuracy,
            "label_auc": self.label_auc,
            "dcor": self.dcor,
            "smashed_rms": self.smashed_rms,
            "gradient_norm": self.gradient_norm,
            # Every number of the reconstruction; its images go to PNGs.
            "reconstruction": None
            if recon is None
            else {f.name: getattr(recon, f.name) for f in fields(recon) if f.name != "images"},
            "seconds": self.seconds,
        }


MakeHooks = Callable[[Case], ClientHooks]


def hooks_for(case: Case, seed: int) -> ClientHooks:
    """The case's defences built from the service's own defence functions, so the attacks
    measure what a client really sends: clipping then noise on z, noise on the returned dL/dh,
    NoPeek on (x, z'); the noise comes from one generator seeded with `seed`."""
    generator = torch.Generator().manual_seed(seed)
    clip = case.clip or None

    def smashed(z: Tensor) -> Tensor:
        return defend(z, case.noise, clip, generator)

    def gradient(g: Tensor) -> Tensor:
        return add_noise(g, case.gradient_noise, generator)

    regulariser = partial(nopeek_loss, weight=case.nopeek) if case.nopeek else None
    return ClientHooks(smashed=smashed, gradient=gradient, regulariser=regulariser)


def binary_task(data: Dataset, positive: int) -> Dataset:
    """The dataset relabelled `positive` vs rest: label 1 for that class, 0 for the others."""

    def relabel(split: Split) -> Split:
        return Split(split.x, (split.y == positive).long())

    return replace(data, train=relabel(data.train), test=relabel(data.test))


def batches(n: int, batch_size: int, seed: int) -> Iterator[Tensor]:
    """Indices of an endless stream of shuffled minibatches, one seeded order per epoch."""
    epoch = 0
    while True:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        epoch += 1


def run_case(
    settings: Settings,
    data: Dataset,
    case: Case,
    budget: Budget,
    make_hooks: MakeHooks,
    *,
    echo: Callable[[str], None] = lambda _: None,
) -> CaseResult:
    started = time.perf_counter()
    net = job_model(settings, seed=settings.job.seed)
    parts = SplitParts.of(net, case.cut, ushaped=case.ushaped)
    defences = make_hooks(case)
    trainer = SplitTrainer(parts, job_hyper(settings), defences)
    result = CaseResult(case)
    train, test = data.train, data.test
    batch_size = settings.algorithm.batch_size
    steps = budget.steps_per_round or len(train) // batch_size
    stream = batches(len(train), batch_size, settings.job.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.job.seed)  # whatever draws from the global stream
        for round_no in range(1, budget.rounds + 1):
            meter = LabelLeakMeter(settings.model.num_classes)
            norms: list[Tensor] = []
            for _ in range(steps):
                index = next(stream)
                record = trainer.step(train.x[index], train.y[index])
                if record.sent_gradient is not None:
                    meter.add(record.sent_gradient, train.y[index])
                    norms.append(norm_scores(record.sent_gradient))
            result.accuracy.append(accuracy(parts, defences, test.x, test.y, budget.eval_batch))
            if case.ushaped:
                result.label_auc.append(meter.aucs())
                result.gradient_norm = float(torch.cat(norms).mean())
            echo(_progress(case, round_no, result))
        z_test = smashed(parts, test.x[: budget.dcor_samples])
        result.smashed_rms = float(z_test.pow(2).mean().sqrt())
        with torch.no_grad():
            z_sent = defences.smashed(z_test)
            result.dcor = float(distance_correlation(test.x[: budget.dcor_samples], z_sent))
        result.reconstruction = _reconstruct(parts, defences, data, budget)
    result.seconds = time.perf_counter() - started
    return result


def grid(
    cuts: Sequence[str],
    modes: Sequence[bool] = (True, False),
    *,
    noises: Sequence[float] = (),
    clip: float = 0.0,
    nopeeks: Sequence[float] = (),
    gradient_noises: Sequence[float] = (),
) -> list[Case]:
    """Per cut and mode (U-shaped first): the undefended case, then each noise scale (with
    `clip`), each NoPeek weight and, U-shaped only, each gradient noise scale on its own."""
    cases = []
    for cut in cuts:
        for ushaped in modes:
            cases.append(Case(cut, ushaped))
            cases += [Case(cut, ushaped, noise=s, clip=clip) for s in noises]
            cases += [Case(cut, ushaped, nopeek=w) for w in nopeeks]
            if ushaped:
                cases += [Case(cut, ushaped, gradient_noise=s) for s in gradient_noises]
    return cases


def _progress(case: Case, round_no: int, result: CaseResult) -> str:
    line = f"{case.label} round {round_no}: accuracy {result.accuracy[-1]:.3f}"
    if result.label_auc:
        auc = result.label_auc[-1]
        line += f", label AUC norm {auc['norm']:.3f} cosine {auc['cosine']:.3f}"
    return line


def _reconstruct(
    parts: SplitParts, defences: ClientHooks, data: Dataset, budget: Budget
) -> Reconstruction:
    public = data.test.x[: budget.public_samples or None]
    private = data.train.x[: budget.private_samples]
    mean = torch.tensor(data.info.mean).view(1, -1, 1, 1)
    std = torch.tensor(data.info.std).view(1, -1, 1, 1)

    def to_unit(x: Tensor) -> Tensor:
        return x * std + mean

    def defence(z: Tensor) -> Tensor:
        with torch.no_grad():
            return defences.smashed(z)

    decoder = train_decoder(smashed(parts, public), public, defence, budget.decoder)
    return evaluate_decoder(decoder, smashed(parts, private), private, public, defence, to_unit)
