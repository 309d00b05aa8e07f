"""Staleness weights of asynchronous (FedBuff-style) aggregation, as pure functions.

An update trained from version `v_base` arrives when the aggregator is at `v_now`; its
staleness is `tau = v_now - v_base` (0: trained on the newest model). The aggregator scales the
update's change by `s(tau)` before folding it in, so old news moves the model less
(Xie et al., FedAsync; Nguyen et al., FedBuff):

- constant:   s(tau) = 1
- polynomial: s(tau) = (1 + tau) ** -a                    (a > 0; the default, a = 0.5)
- hinge:      s(tau) = 1 if tau <= b else 1 / (a * (tau - b) + 1)

Every function gives s(0) = 1 and never increases with tau, so an update on the newest model
counts in full, whatever the choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The code of every refusal for staleness: the aggregator's Error code, and the head of a
# worker's GradientReply reason ("too_stale: ..."), on which a client fetches newer weights.
TOO_STALE = "too_stale"

StalenessKind = Literal["constant", "polynomial", "hinge"]
STALENESS_KINDS: tuple[StalenessKind, ...] = ("constant", "polynomial", "hinge")


@dataclass(frozen=True)
class StalenessRule:
    """One configured staleness function, plus the bound beyond which an update is refused."""

    kind: StalenessKind = "polynomial"
    a: float = 0.5
    b: int = 4
    max_staleness: int = 4

    def __post_init__(self) -> None:
        if self.kind not in STALENESS_KINDS:
            raise ValueError(f"unknown staleness function {self.kind!r}; use {STALENESS_KINDS}")
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.kind == "polynomial" and self.a < 0:
            raise ValueError(f"polynomial staleness needs a >= 0, got {self.a}")
        if self.kind == "hinge" and (self.a < 0 or self.b < 0):
            raise ValueError(f"hinge staleness needs a >= 0 and b >= 0, got a={self.a}, b={self.b}")

    def weight(self, tau: int) -> float:
        """s(tau) (module docstring); raises ValueError for tau < 0."""
        if tau < 0:
            raise ValueError(
                f"staleness must be >= 0, got {tau} (an update from a future version?)"
            )
        if self.kind == "polynomial":
            return float((1.0 + tau) ** -self.a)
        if self.kind == "hinge" and tau > self.b:
            return 1.0 / (self.a * (tau - self.b) + 1.0)
        return 1.0

    def accepts(self, tau: int) -> bool:
        """Whether an update this stale is folded in at all."""
        return 0 <= tau <= self.max_staleness
