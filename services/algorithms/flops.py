"""A small FLOP counter for Conv2d and Linear layers that honours pruning masks.

Per sample, each kept weight entry of a conv does one multiply-accumulate (2 FLOPs, as
`models.flops` counts) at every output position, each of a Linear once per output row. A
pruned channel removes its whole filter and the next layer's slice that reads it, which the
element masks already encode. Biases, BatchNorm, activations and pooling are not counted;
they are a small share of these models' work.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models.split import SplitNet


@dataclass(frozen=True)
class FlopCount:
    sparse: int  # FLOPs with the masks applied
    dense: int  # FLOPs of the unpruned layers

    @property
    def reduction(self) -> float:
        return 1.0 - self.sparse / self.dense if self.dense else 0.0


def output_positions(model: SplitNet, prefixes: tuple[str, ...]) -> dict[str, int]:
    """Per Conv2d/Linear module in scope: how many times each weight entry is used for one
    sample (output height x width for a conv, 1 for a Linear on flat input)."""
    found: dict[str, int] = {}
    hooks = []

    def record(name: str, width: int) -> Callable[[nn.Module, Any, torch.Tensor], None]:
        def hook(_m: nn.Module, _inputs: Any, out: torch.Tensor) -> None:
            found[name] = out.numel() // (out.shape[0] * width)

        return hook

    for name, module in model.named_modules():
        if not f"{name}.".startswith(prefixes):
            continue
        if isinstance(module, nn.Conv2d):
            hooks.append(module.register_forward_hook(record(name, module.out_channels)))
        elif isinstance(module, nn.Linear):
            hooks.append(module.register_forward_hook(record(name, module.out_features)))
    flags = [(m, m.training) for m in model.modules()]
    model.eval()  # a dummy forward must not move BatchNorm's running statistics
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            model(torch.zeros((1, *model.input_shape), device=device))
    finally:
        for handle in hooks:
            handle.remove()
        for module, training in flags:
            module.train(training)
    return found


def count_flops(
    model: SplitNet,
    prefixes: tuple[str, ...],
    masks: Mapping[str, torch.Tensor],
    positions: Mapping[str, int] | None = None,
) -> FlopCount:
    """FLOPs per sample of the Conv2d/Linear layers in scope, with and without `masks`."""
    where = output_positions(model, prefixes) if positions is None else positions
    sparse = dense = 0
    for name, uses in where.items():
        weight = f"{name}.weight"
        total = model.get_parameter(weight).numel()
        mask = masks.get(weight)
        kept = total if mask is None else int(mask.bool().sum())
        dense += 2 * total * uses
        sparse += 2 * kept * uses
    return FlopCount(sparse, dense)
