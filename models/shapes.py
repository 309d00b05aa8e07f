"""Activation shapes of a chain of modules, found by a dummy forward that changes no state."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from models.errors import ModelSpecError

Shape = tuple[int, ...]

# Two samples, not one: a module may squeeze or normalise across the batch dimension.
_PROBE_BATCH = 2


def infer_shapes(modules: Sequence[nn.Module], input_shape: Sequence[int]) -> list[Shape]:
    """The per-sample output shape of each module when they are applied in order.

    Runs one forward of a zero batch in eval mode without autograd, then restores every
    training flag, so BatchNorm running stats and dropout state are untouched. (The meta device
    would skip the compute, but its first use imports ~2 s of decompositions per process,
    more than a 2-sample forward of ResNet-18 costs on a CPU.)
    """
    x = torch.zeros((_PROBE_BATCH, *input_shape), device=_device_of(modules))
    shapes: list[Shape] = []
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        with torch.no_grad():
            for module in modules:
                try:
                    x = module(x)
                except Exception as exc:
                    raise ModelSpecError(
                        f"dummy forward of {type(module).__name__} on input shape "
                        f"{tuple(x.shape[1:])} failed: {exc}"
                    ) from exc
                shapes.append(_per_sample(x, module))
    finally:
        for m, training in flags:
            m.training = training
    return shapes


def _per_sample(x: object, module: nn.Module) -> Shape:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != _PROBE_BATCH:
        raise ModelSpecError(
            f"{type(module).__name__} must map a batch tensor to a batch tensor; "
            f"got {type(x).__name__}"
            + (f" of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
        )
    return tuple(int(d) for d in x.shape[1:])


def _device_of(modules: Sequence[nn.Module]) -> torch.device:
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            return tensor.device
    return torch.device("cpu")


def flat_features(modules: Sequence[nn.Module], input_shape: Sequence[int]) -> int:
    """How many features the output of `modules` has per sample once flattened."""
    shapes = infer_shapes(modules, input_shape)
    return math.prod(shapes[-1]) if shapes else math.prod(input_shape)
