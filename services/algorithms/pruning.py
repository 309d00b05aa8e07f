"""Sub-FedAvg's mask math (Vahidian et al.), as pure functions over named tensors, and which
tensors of a `SplitNet` it prunes.

A mask is a bool tensor of its weight's shape, True where the weight is kept; `Masks` maps the
full model's state-dict names to masks. Masks only ever shrink: a pruned weight stays pruned.

Unstructured: the weights of every Conv2d and Linear in scope, by |w| per layer. Hybrid: conv
layers lose whole output channels, chosen by the |scale| (gamma) of the BatchNorm2d after
them; a pruned channel masks its conv filter and bias, its BN entries (running statistics
too, so that the server averages them over the clients that keep the channel), the next
conv's input slice, and the columns of the first Linear that read it after the flatten; the
Linear layers are pruned by |w| as in the unstructured variant. Channel masks only compose in
a plain conv-BN chain, so hybrid refuses models with residual or grouped convolutions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

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


# --- which tensors are pruned ---------------------------------------------------------------

Mode = Literal["unstructured", "hybrid"]
BN_ENTRIES = ("weight", "bias", "running_mean", "running_var")


@dataclass(frozen=True)
class ConvUnit:
    """A conv layer and the BatchNorm2d after it: one channel mask."""

    conv: str  # module names ("blocks.0.conv")
    bn: str
    channels: int
    has_bias: bool
    source: int  # the unit whose channels this conv reads; -1: the model's input


@dataclass(frozen=True)
class FlatLinear:
    """The Linear that reads the last conv unit's flattened output."""

    name: str
    unit: int
    group: int  # columns per channel (the spatial size after the last conv)


@dataclass(frozen=True)
class PruneLayout:
    mode: Mode
    prefixes: tuple[str, ...]  # state-name prefixes of the blocks in scope
    weights: tuple[str, ...]  # weights pruned by |w|
    units: tuple[ConvUnit, ...] = ()  # hybrid only
    flat: FlatLinear | None = None
    shapes: Mapping[str, torch.Size] = field(default_factory=dict)  # the model's state shapes

    def params(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters in scope (what the parameter reduction is counted over)."""
        return {n: p for n, p in model.named_parameters() if n.startswith(self.prefixes)}

    def element_masks(
        self, weights: Mapping[str, torch.Tensor], channels: Mapping[str, torch.Tensor]
    ) -> Masks:
        """Masks of every pruned tensor: `weights` (the |w| masks) combined with what the
        `channels` prune."""
        out: Masks = {n: m.bool().clone() for n, m in weights.items()}
        for unit in self.units:
            keep = channels[unit.bn].bool()
            rows = keep.view(-1, 1, 1, 1)
            if unit.source >= 0:
                rows = rows & channels[self.units[unit.source].bn].bool().view(1, -1, 1, 1)
            out[f"{unit.conv}.weight"] = rows.expand(self.shapes[f"{unit.conv}.weight"]).clone()
            if unit.has_bias:
                out[f"{unit.conv}.bias"] = keep.clone()
            for entry in BN_ENTRIES:
                out[f"{unit.bn}.{entry}"] = keep.clone()
        if self.flat is not None:
            name = f"{self.flat.name}.weight"
            feeding = channels[self.units[self.flat.unit].bn].bool()
            columns = feeding.repeat_interleave(self.flat.group).view(1, -1)
            out[name] = out[name] & columns
        return out


def build_layout(model: SplitNet, mode: Mode, blocks: Sequence[int]) -> PruneLayout:
    """The pruning layout of `model`'s blocks `blocks` (heads are never pruned)."""
    if not blocks:
        raise ValueError("no blocks in scope")
    for i in blocks:
        model.block_range(i, i + 1)  # validates the index
    prefixes = tuple(f"blocks.{i}." for i in blocks)
    modules = [(n, m) for n, m in model.named_modules() if f"{n}.".startswith(prefixes)]
    shapes = {n: t.shape for n, t in model.state_dict().items()}
    if mode == "unstructured":
        weights = tuple(f"{n}.weight" for n, m in modules if isinstance(m, nn.Conv2d | nn.Linear))
        return PruneLayout(mode, prefixes, weights, shapes=shapes)
    return replace(_hybrid(prefixes, modules), shapes=shapes)


def _hybrid(prefixes: tuple[str, ...], modules: list[tuple[str, nn.Module]]) -> PruneLayout:
    units: list[ConvUnit] = []
    linears: list[str] = []
    flat: FlatLinear | None = None
    pending: tuple[str, nn.Conv2d] | None = None
    for name, module in modules:
        if isinstance(module, nn.Conv2d):
            if pending is not None or linears:
                raise ValueError(f"hybrid pruning: {name} does not follow a conv-BN pair")
            if module.groups != 1:
                raise ValueError(f"hybrid pruning: grouped convolution {name} is not supported")
            if units and units[-1].channels != module.in_channels:
                raise ValueError(
                    f"hybrid pruning needs a plain conv-BN chain; {name} reads "
                    f"{module.in_channels} channels, the previous layer gives {units[-1].channels}"
                )
            pending = (name, module)
        elif isinstance(module, nn.BatchNorm2d):
            if pending is None or pending[1].out_channels != module.num_features:
                raise ValueError(f"hybrid pruning: {name} does not follow its conv layer")
            conv_name, conv = pending
            units.append(
                ConvUnit(conv_name, name, conv.out_channels, conv.bias is not None, len(units) - 1)
            )
            pending = None
        elif isinstance(module, nn.Linear):
            if not linears and units:
                channels = units[-1].channels
                if module.in_features % channels:
                    raise ValueError(
                        f"hybrid pruning: {name} reads {module.in_features} features, not a "
                        f"multiple of the {channels} channels before it"
                    )
                flat = FlatLinear(name, len(units) - 1, module.in_features // channels)
            linears.append(f"{name}.weight")
    if pending is not None:
        raise ValueError(f"hybrid pruning: conv layer {pending[0]} has no BatchNorm2d after it")
    return PruneLayout("hybrid", prefixes, tuple(linears), tuple(units), flat)
