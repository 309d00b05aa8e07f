"""Sub-FedAvg's server rule: intersection averaging of masked client models, a pure function."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from services.algorithms.averaging import normalised, weighted_average

State = Mapping[str, torch.Tensor]


def intersection_average(
    previous: State,
    states: Sequence[State],
    masks: Sequence[State],
    weights: Sequence[float] | None = None,
) -> dict[str, torch.Tensor]:
    """Average each element over the clients whose mask keeps it.

    For a tensor some client masks: `w = sum_k a_k m_k w_k / sum_k a_k m_k` per element, where
    `m_k` is 1 where client k keeps the element (a client without a mask for that tensor keeps
    all of it) and `a_k` its weight (`weights`; equal weights when None, as the paper and its
    reference code do); an element no client keeps (count 0) keeps its `previous` value.
    Tensors nobody masks are the plain `a_k`-weighted average (integer buffers: the maximum).
    """
    if not states:
        raise ValueError("no client states to average")
    if len(masks) != len(states):
        raise ValueError(f"{len(states)} states but {len(masks)} mask sets")
    alphas = normalised([1.0] * len(states) if weights is None else list(weights))
    masked = {name for m in masks for name in m}
    plain = [{n: t for n, t in s.items() if n not in masked} for s in states]
    out = weighted_average(plain, alphas)
    for name in sorted(masked):
        out[name] = _masked_mean(name, previous, states, masks, alphas)
    return out


def _masked_mean(
    name: str,
    previous: State,
    states: Sequence[State],
    masks: Sequence[State],
    alphas: Sequence[float],
) -> torch.Tensor:
    if name not in previous:
        raise ValueError(f"{name}: masked by a client but absent from the previous version")
    old = previous[name]
    num = torch.zeros(old.shape, dtype=torch.float64)
    den = torch.zeros(old.shape, dtype=torch.float64)
    for k, (state, mask_set) in enumerate(zip(states, masks, strict=True)):
        if name not in state:
            raise ValueError(f"state {k} lacks the masked tensor {name}")
        value = state[name].detach().to(torch.float64)
        if value.shape != old.shape:
            raise ValueError(
                f"{name}: shape {tuple(value.shape)} in state {k}, expected {tuple(old.shape)}"
            )
        mask = mask_set.get(name)
        keep = torch.ones_like(den) if mask is None else mask.to(torch.float64)
        if keep.shape != old.shape:
            raise ValueError(f"{name}: mask shape {tuple(keep.shape)} in state {k}")
        num.add_(keep * value, alpha=alphas[k])
        den.add_(keep, alpha=alphas[k])
    averaged = torch.where(den > 0, num / den.clamp_min(1e-300), old.detach().to(torch.float64))
    return averaged.to(old.dtype)
