"""Sub-FedAvg's mask math (Vahidian et al.), as pure functions over named tensors.

A mask is a bool tensor of its weight's shape, True where the weight is kept; `Masks` maps the
full model's state-dict names to masks. Masks only ever shrink: a pruned weight stays pruned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from models.flops import flops_by_layer
from models.split import SplitNet

Masks = dict[str, torch.Tensor]


def percentile_mask(weight: torch.Tensor, mask: torch.Tensor, percent: float) -> torch.Tensor:
    """`mask` with the `percent` fraction of its alive |w| pruned (one layer).

    The threshold is the `percent` quantile of the alive |w| (linear interpolation, numpy's
    default, as the reference's `np.percentile`); weights strictly below it are pruned, so ties
    at the threshold survive and a layer whose alive weights are all equal keeps them all.
    """
    if weight.shape != mask.shape:
        raise ValueError(f"weight {tuple(weight.shape)} and mask {tuple(mask.shape)} differ")
    magnitude = weight.detach().abs().cpu()
    keep = mask.cpu().bool()
    alive = magnitude[keep]
    if alive.numel() == 0 or percent <= 0:
        return keep.clone()
    threshold = float(np.percentile(alive.double().numpy(), 100.0 * percent))
    return keep & (magnitude >= threshold)


def channel_mask(
    scale: torch.Tensor, alive: torch.Tensor, percent: float, floor: int
) -> torch.Tensor:
    """Channels of one conv layer to keep, pruned by the |BN scale| (gamma) of the alive ones.

    The reference's rule (`fake_prune_ch`): over the n alive channels, the threshold is the
    `floor(n * percent)`-th smallest |gamma| (0-based) and channels at or below it go, i.e.
    `floor(n * percent) + 1` of them when the values are distinct. If fewer than `floor`
    channels would survive, the layer is left as it is (the reference's `cfg_prune`).
    """
    if scale.shape != alive.shape or scale.dim() != 1:
        raise ValueError(f"scale {tuple(scale.shape)} and alive {tuple(alive.shape)} differ")
    magnitude = scale.detach().abs().cpu()
    keep = alive.cpu().bool()
    values = magnitude[keep].sort().values
    if values.numel() == 0 or percent <= 0:
        return keep.clone()
    threshold = values[min(int(values.numel() * percent), values.numel() - 1)]
    kept = keep & (magnitude > threshold)
    if int(kept.sum()) < floor:
        return keep.clone()
    return kept


def hamming_distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """Mean over the tensors of the fraction of entries where `a` and `b` differ (the
    reference's `dist_masks`: scipy's Hamming distance per layer, averaged over layers)."""
    if set(a) != set(b):
        raise ValueError(f"masks name different tensors: {sorted(set(a) ^ set(b))[:3]}")
    if not a:
        return 0.0
    fractions = [
        float((a[n].bool() != b[n].bool()).double().mean()) if a[n].numel() else 0.0 for n in a
    ]
    return sum(fractions) / len(fractions)


def flat_hamming(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """Fraction of differing entries over the concatenation (the reference's channel distance)."""
    left = torch.cat([t.reshape(-1).bool() for t in a]) if a else torch.zeros(0, dtype=torch.bool)
    right = torch.cat([t.reshape(-1).bool() for t in b]) if b else torch.zeros(0, dtype=torch.bool)
    if left.shape != right.shape:
        raise ValueError(f"{left.numel()} entries against {right.numel()}")
    return float((left != right).double().mean()) if left.numel() else 0.0


def step_percent(percent: float, sparsity: float, target: float) -> float:
    """The fraction of the alive weights to prune next so that the sparsity does not pass the
    target: `min(percent, (target - s) / (1 - s))` (0 once the target is reached)."""
    if sparsity >= target or sparsity >= 1.0:
        return 0.0
    return min(percent, (target - sparsity) / (1.0 - sparsity))


@dataclass(frozen=True)
class AdoptionRule:
    """When a client adopts a newly derived mask.

    It tries the mask when the masks derived after the first and the last epoch differ by more
    than `dist_thresh` (mean Hamming distance) and the sparsity is still below `target`; it
    keeps it when the model pruned with it scores above `acc_thresh` on the local test set.
    """

    dist_thresh: float
    target: float
    acc_thresh: float

    def should_try(self, distance: float, sparsity: float) -> bool:
        return distance > self.dist_thresh and sparsity < self.target

    def accepts(self, accuracy: float) -> bool:
        return accuracy > self.acc_thresh


def apply_masks(module: nn.Module, masks: Mapping[str, torch.Tensor]) -> None:
    """Zero, in place, the entries of `module`'s state that `masks` prunes."""
    state = module.state_dict()
    with torch.no_grad():
        for name, mask in masks.items():
            tensor = state[name]
            tensor.mul_(mask.to(device=tensor.device, dtype=tensor.dtype))


def gradient_masker(module: nn.Module, masks: Mapping[str, torch.Tensor]) -> Callable[[], None]:
    """A call that zeroes the gradients of pruned weights, so that no optimizer step (momentum
    included: its buffer only ever sees zeros there) moves them off zero. The masks are cast to
    their parameters' dtype here, once per round, not at every step."""
    pairs = [
        (param, masks[name].to(device=param.device, dtype=param.dtype))
        for name, param in module.named_parameters()
        if name in masks
    ]

    def mask() -> None:
        for param, kept in pairs:
            if param.grad is not None:
                param.grad.mul_(kept)

    return mask


def masked_state(
    state: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """A copy of `state` with the masked entries zeroed (a personalised model)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        mask = masks.get(name)
        out[name] = tensor.clone() if mask is None else tensor * mask.to(dtype=tensor.dtype)
    return out


def param_reduction(params: Mapping[str, torch.Tensor], masks: Mapping[str, torch.Tensor]) -> float:
    """The fraction of the parameters in `params` that `masks` prunes (buffers excluded)."""
    total = sum(p.numel() for p in params.values())
    if total == 0:
        return 0.0
    pruned = sum(int((~masks[n].bool()).sum()) for n in params if n in masks)
    return pruned / total


@dataclass(frozen=True)
class FlopCount:
    """Forward FLOPs per sample (`models.flops`) with the masks applied, and without. A pruned
    weight entry saves every multiply-accumulate it takes part in; a pruned channel removes its
    filter and the next layer's slice that reads it, which the element masks already encode."""

    sparse: int
    dense: int

    @property
    def reduction(self) -> float:
        return 1.0 - self.sparse / self.dense if self.dense else 0.0


def count_flops(
    model: SplitNet, prefixes: tuple[str, ...], masks: Mapping[str, torch.Tensor]
) -> FlopCount:
    """FLOPs per sample of the Conv2d/Linear layers in scope, with and without `masks`."""
    sparse = dense = 0
    for name, flops in flops_by_layer(model, model.input_shape).items():
        if not f"{name}.".startswith(prefixes):
            continue
        total = model.get_parameter(f"{name}.weight").numel()
        mask = masks.get(f"{name}.weight")
        kept = total if mask is None else int(mask.bool().sum())
        dense += flops
        sparse += flops * kept // total
    return FlopCount(sparse, dense)
