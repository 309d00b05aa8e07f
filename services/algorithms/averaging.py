"""Weighted averaging of named tensors: FedAvg's rule and its variants, as pure functions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

State = Mapping[str, torch.Tensor]


def normalised(weights: Sequence[float]) -> list[float]:
    """`weights / sum(weights)`; raises on an empty or all-zero list (nothing to average)."""
    total = float(sum(weights))
    if not weights or total <= 0.0:
        raise ValueError(f"cannot average with weights {list(weights)}: their sum must be > 0")
    if any(w < 0 for w in weights):
        raise ValueError(f"negative averaging weight in {list(weights)}")
    return [float(w) / total for w in weights]


def weighted_average(states: Sequence[State], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """`sum_k alpha_k * w_k` over states with identical names and shapes.

    Floating tensors are accumulated in float64 and cast back, so the result does not depend on
    the order of the states beyond float64 rounding. Integer tensors (BatchNorm's
    `num_batches_tracked`) are counters, not parameters: they take the maximum.
    """
    if len(states) != len(weights):
        raise ValueError(f"{len(states)} states but {len(weights)} weights")
    alphas = normalised(weights)
    names = list(states[0].keys())
    for i, state in enumerate(states[1:], start=1):
        if set(state.keys()) != set(names):
            diff = sorted(set(state.keys()) ^ set(names))
            raise ValueError(f"state {i} has different tensor names: {diff[:5]}")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        first = states[0][name]
        for i, state in enumerate(states):
            if state[name].shape != first.shape:
                raise ValueError(
                    f"{name}: shape {tuple(state[name].shape)} in state {i} "
                    f"differs from {tuple(first.shape)}"
                )
        if first.is_floating_point():
            acc = torch.zeros(first.shape, dtype=torch.float64)
            for alpha, state in zip(alphas, states, strict=True):
                acc.add_(state[name].detach().to(torch.float64), alpha=alpha)
            out[name] = acc.to(first.dtype)
        else:
            out[name] = torch.stack([s[name].detach() for s in states]).amax(dim=0)
    return out


def heteroavg(holdings: Sequence[tuple[State, float]], previous: State) -> dict[str, torch.Tensor]:
    """Each tensor of `previous` averaged over the holders (state, samples) that hold it
    (FedSplitX's heteroavg). Per name, the weights of its holders are renormalised, so a deep
    layer trained only by high-level clients is their mean; a tensor nobody holds keeps its
    previous value. Holders with no samples are ignored."""
    held = [(state, weight) for state, weight in holdings if weight > 0 and state]
    names = dict.fromkeys(n for state, _ in held for n in state)
    unknown = sorted(set(names) - set(previous))
    if unknown:
        raise ValueError(f"holders name tensors the model does not have: {unknown[:5]}")
    out = dict(previous)
    for name in names:
        holders = [(s, w) for s, w in held if name in s]
        avg = weighted_average([{name: s[name]} for s, _ in holders], [w for _, w in holders])
        out[name] = avg[name]
    return out
