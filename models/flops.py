"""Forward FLOPs per sample of a module, counted on its Conv2d and Linear layers.

Convention: one multiply-accumulate is 2 FLOPs; biases, normalisation, activations and pooling
are not counted (they are a few percent of a conv net's work). A training step costs about
three forwards (forward, gradient w.r.t. the input, gradient w.r.t. the weights).

The count comes from one eval-mode, no-grad forward of a single zero sample with hooks on the
layers, so it follows whatever path the module's `forward` takes; every training flag is
restored and no state changes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch
from torch import Tensor, nn

from models.split import evaluating


def layer_flops(module: nn.Module, inputs: Tensor, output: Tensor) -> int:
    """FLOPs per sample of one Conv2d or Linear call (0 for any other module)."""
    if isinstance(module, nn.Conv2d):
        # Each output element takes (in_channels / groups) * kh * kw multiply-accumulates.
        per_output = (module.in_channels // module.groups) * math.prod(module.kernel_size)
        return 2 * per_output * math.prod(output.shape[1:])
    if isinstance(module, nn.Linear):
        rows = math.prod(inputs.shape[1:-1])  # a Linear may act on (N, ..., F)
        return 2 * module.in_features * module.out_features * rows
    return 0


def flops_by_layer(module: nn.Module, input_shape: Sequence[int]) -> dict[str, int]:
    """Forward FLOPs for one sample of `input_shape` (batch dimension excluded) of each Conv2d
    and Linear that `module`'s forward runs, by module name."""
    found: dict[str, int] = {}

    def count(name: str, layer: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        found[name] = found.get(name, 0) + layer_flops(layer, args[0], output)

    layers = [(n, m) for n, m in module.named_modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    handles = [layer.register_forward_hook(partial(count, name)) for name, layer in layers]
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    try:
        with evaluating([module]):
            module(torch.zeros((1, *input_shape), device=device))
    finally:
        for handle in handles:
            handle.remove()
    return found


def forward_flops(module: nn.Module, input_shape: Sequence[int]) -> int:
    """Forward FLOPs of `module` for one sample of `input_shape` (batch dimension excluded)."""
    return sum(flops_by_layer(module, input_shape).values())
