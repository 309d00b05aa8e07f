"""Which tensors of a `SplitNet` Sub-FedAvg prunes, and how channel masks become element masks.

Unstructured: the weights of every Conv2d and Linear in scope, by |w| per layer. Hybrid: conv
layers lose whole output channels, chosen by the |scale| (gamma) of the BatchNorm2d after
them; a pruned channel masks its conv filter and bias, its BN entries (running statistics
too, so that the server averages them over the clients that keep the channel), the next
conv's input slice, and the columns of the first Linear that read it after the flatten; the
Linear layers are pruned by |w| as in the unstructured variant. Channel masks only compose in
a plain conv-BN chain, so hybrid refuses models with residual or grouped convolutions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import torch
from torch import nn

from models.split import SplitNet
from services.algorithms.pruning import Masks

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
