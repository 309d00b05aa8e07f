"""Defences on smashed data, applied on the client before z leaves it (docs/privacy.md
"Defences"): per-sample L2 clipping, Gaussian noise (SplitGP's noise layer) and NoPeek's
distance-correlation penalty.

    z' = clip_C(z) + N(0, sigma^2 I),   clip_C(z)_i = z_i * min(1, C / ||z_i||_2)
    client loss += alpha * dCor_n(x, z')

`sigma` is `noise_scale` itself, in z's units, with or without clipping: the clipping bounds
each sample's norm so that a given sigma means a known worst-case signal-to-noise ratio, and
changing C never changes the noise. Everything is differentiable in z, so the gradient the
client backpropagates is that of the defended forward: the server's dL/dz' through the clip
(the noise is an additive constant), plus alpha * d dCor / dz. dCor_n is the (biased,
V-statistic) sample distance correlation of Szekely, Rizzo and Bakirov (2007).

The settings travel to clients among the algorithm's parameters under `privacy.` keys
(`KEY_PREFIX`); `AlgorithmSpec.build` splits them off into the strategy's `defences`, so one
helper (`StrategyBase.smashed`) applies them in every split algorithm's client step (SFL's
step skips it, and this module, when every defence is off).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

# Parameter keys of the defences among an algorithm's parameters (the `params.` config map).
KEY_PREFIX = "privacy."
NOISE_SCALE = "noise_scale"
CLIP_NORM = "clip_norm"
NOPEEK_WEIGHT = "nopeek_weight"
SEED = "seed"


@dataclass(frozen=True)
class Defences:
    """What a client does to its smashed data; all off by default."""

    noise_scale: float = 0.0  # sigma; 0: no noise
    clip_norm: float | None = None  # C; None: no clipping
    nopeek_weight: float = 0.0  # alpha; 0: no penalty
    seed: int = 0  # the job's: the noise of (client, round, step) is a function of it

    def __post_init__(self) -> None:
        _check(NOISE_SCALE, self.noise_scale, "a finite number >= 0", lambda v: v >= 0)
        _check(NOPEEK_WEIGHT, self.nopeek_weight, "a finite number >= 0", lambda v: v >= 0)
        if self.clip_norm is not None:
            _check(CLIP_NORM, self.clip_norm, "a finite number > 0", lambda v: v > 0)

    @property
    def active(self) -> bool:
        return bool(self.noise_scale or self.clip_norm is not None or self.nopeek_weight)

    @classmethod
    def split(cls, params: Mapping[str, object]) -> tuple[Defences, dict[str, object]]:
        """The defences among `params` (keys `privacy.<setting>`) and the other parameters;
        `ValueError` naming the setting when one is unknown or out of range."""
        own = {k: v for k, v in params.items() if not k.startswith(KEY_PREFIX)}
        given = {k[len(KEY_PREFIX) :]: v for k, v in params.items() if k.startswith(KEY_PREFIX)}
        unknown = sorted(set(given) - {NOISE_SCALE, CLIP_NORM, NOPEEK_WEIGHT, SEED})
        if unknown:
            raise ValueError(f"unknown privacy setting(s) {[KEY_PREFIX + k for k in unknown]}")
        seed = given.get(SEED, 0)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"{KEY_PREFIX}{SEED} must be an integer, got {seed!r}")
        clip = given.get(CLIP_NORM)
        defences = cls(
            noise_scale=_number(given, NOISE_SCALE, 0.0),
            clip_norm=None if clip is None else _number(given, CLIP_NORM, 0.0),
            nopeek_weight=_number(given, NOPEEK_WEIGHT, 0.0),
            seed=seed,
        )
        return defences, own

    def generator(
        self, device: torch.device, client: str, round_index: int, step: int
    ) -> torch.Generator:
        """The noise stream of one step of one client: the same in every run of the job."""
        key = f"{self.seed}/{client}/{round_index}/{step}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def apply(
        self, x: torch.Tensor, z: torch.Tensor, generator: torch.Generator | None = None
    ) -> Smashed:
        """z' and the penalty for one batch; `generator` draws the noise (needed with noise)."""
        if not self.active:
            return Smashed(z, None)
        sent = defend(z, self.noise_scale, self.clip_norm, generator)
        penalty = nopeek_loss(x, sent, self.nopeek_weight) if self.nopeek_weight else None
        return Smashed(sent, penalty)


@dataclass(frozen=True)
class Smashed:
    """One step's smashed data as the client sends it, in the graph of the client's forward,
    and the client's own penalty on it (None: none)."""

    sent: torch.Tensor
    penalty: torch.Tensor | None = None

    def wire(self) -> torch.Tensor:
        """What goes to the server."""
        return self.sent.detach()

    def backward(self, grad: torch.Tensor) -> None:
        """Backprop the server's dL/dz' through the defences, and the penalty."""
        g = grad.to(device=self.sent.device, dtype=self.sent.dtype)
        if self.penalty is None:
            self.sent.backward(g)
        else:
            torch.autograd.backward([self.sent, self.penalty], [g, torch.ones_like(self.penalty)])

    def with_penalty(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` plus the penalty (itself when there is none)."""
        return loss if self.penalty is None else loss + self.penalty


# --- the pure functions ---------------------------------------------------------------------


def clip_rows(z: torch.Tensor, bound: float) -> torch.Tensor:
    """Each sample (row of the first dimension) scaled to an L2 norm of at most `bound`; a
    sample within it is unchanged. Differentiable (the scale is part of the graph)."""
    norms: torch.Tensor = z.flatten(1).norm(dim=1)
    # bound / max(norm, bound): 1 inside the ball without dividing by a zero norm.
    scale = bound / norms.clamp(min=bound)
    shape = (-1, *([1] * (z.dim() - 1)))
    return z * scale.view(shape)


def add_noise(z: torch.Tensor, scale: float, generator: torch.Generator | None) -> torch.Tensor:
    """z + N(0, scale^2 I), drawn from `generator` (on z's device)."""
    if scale == 0:
        return z
    if generator is None:
        raise ValueError("noise needs a generator: a seeded one keeps runs reproducible")
    noise = torch.randn(z.shape, generator=generator, device=z.device, dtype=z.dtype)
    return z + scale * noise


def defend(
    z: torch.Tensor,
    noise_scale: float,
    clip_norm: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """z' = clip_C(z) + N(0, sigma^2 I): the clip first, so that sigma is relative to a bound."""
    clipped = z if clip_norm is None else clip_rows(z, clip_norm)
    return add_noise(clipped, noise_scale, generator)


def _centred_distances(rows: torch.Tensor) -> torch.Tensor:
    """The double-centred Euclidean distance matrix A_jk = a_jk - a_j. - a_.k + a_.. ."""
    flat = rows.flatten(1)
    # cdist's gradient at a zero distance (the diagonal, duplicate rows) is 0, not NaN.
    a = torch.cdist(flat, flat)
    return a - a.mean(dim=0, keepdim=True) - a.mean(dim=1, keepdim=True) + a.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """dCor_n(x, z) in [0, 1] over the batch (rows of the first dimension, each flattened):
    sqrt(dCov_n^2(x, z) / sqrt(dVar_n^2(x) dVar_n^2(z))), with dCov_n^2 = mean_jk A_jk B_jk
    of the double-centred distance matrices (the V-statistic, Szekely et al. 2007); 0 when
    either side has no spread (one row, or all rows equal). Differentiable in both."""
    if x.shape[0] != z.shape[0]:
        raise ValueError(f"x and z need the same batch size, got {x.shape[0]} and {z.shape[0]}")
    a = _centred_distances(x.to(z.dtype))
    b = _centred_distances(z)
    dvar = (a * a).mean() * (b * b).mean()
    if not dvar > 0:
        return z.new_zeros(())
    dcov = (a * b).mean().clamp(min=0)
    return (dcov / dvar.sqrt()).sqrt()


def nopeek_loss(x: torch.Tensor, z: torch.Tensor, weight: float) -> torch.Tensor:
    """NoPeek's term of the client's loss: weight * dCor_n(x, z)."""
    return weight * distance_correlation(x, z)


def _check(name: str, value: float, expected: str, ok: Callable[[float], bool]) -> None:
    number = not isinstance(value, bool) and isinstance(value, int | float)
    if not (number and math.isfinite(value) and ok(value)):
        raise ValueError(f"{KEY_PREFIX}{name} must be {expected}, got {value!r}")


def _number(given: Mapping[str, object], name: str, default: float) -> float:
    value = given.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{KEY_PREFIX}{name} must be a number, got {value!r}")
    return float(value)
