"""Named slices of a `SplitNet`'s state dict, and loading a slice back.

Every slice keeps the full model's names (`blocks.<i>.<...>`, `heads.<cut>.<...>`) and holds
parameters and buffers alike (BatchNorm running stats travel with their layer). The tensors
are those of `state_dict()`: detached and sharing storage with the model, so clone before
mutating one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import Tensor, nn

from models.errors import StateDictError
from models.split import SplitNet

_SHOWN = 5  # names quoted in an error message before "... and N more"


def range_state(model: SplitNet, start: int, stop: int) -> dict[str, Tensor]:
    """State of blocks `[start:stop]`."""
    model.block_range(start, stop)  # validates the range
    return _with_prefixes(model, [f"blocks.{i}." for i in range(start, stop)])


def client_state(model: SplitNet, cut: str) -> dict[str, Tensor]:
    """State of the blocks up to and including `cut`, and of a U-shaped split's tail."""
    state = range_state(model, 0, model.cut_index(cut) + 1)
    if model.tail is not None:
        state.update(range_state(model, model.server_end(), len(model.blocks)))
    return state


def server_state(model: SplitNet, cut: str) -> dict[str, Tensor]:
    """State of the blocks after `cut` (up to a U-shaped split's tail)."""
    return range_state(model, model.cut_index(cut) + 1, model.server_end())


def head_state(model: SplitNet, cuts: Iterable[str]) -> dict[str, Tensor]:
    """State of the heads of `cuts`."""
    prefixes = []
    for cut in cuts:
        model.cut_index(cut)  # validates the name
        prefixes.append(f"heads.{cut}.")
    return _with_prefixes(model, prefixes)


def load_partial(module: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Copy `state` into the entries of `module.state_dict()` of the same names.

    Entries absent from `state` keep their values. Raises `StateDictError`, before copying
    anything, when a name is unknown, a value is not a tensor, or a shape differs.
    """
    own = module.state_dict()
    unknown = sorted(name for name in state if name not in own)
    not_tensors = sorted(
        name for name, value in state.items() if not isinstance(value, torch.Tensor)
    )
    mismatched = [
        f"{name} {tuple(value.shape)} (model has {tuple(own[name].shape)})"
        for name, value in state.items()
        if name in own and isinstance(value, torch.Tensor) and value.shape != own[name].shape
    ]
    problems = [
        _describe("unknown names", unknown),
        _describe("values that are not tensors", not_tensors),
        _describe("shape mismatches", mismatched),
    ]
    message = "; ".join(p for p in problems if p)
    if message:
        raise StateDictError(f"cannot load partial state into {type(module).__name__}: {message}")
    module.load_state_dict(state, strict=False)


def _with_prefixes(model: nn.Module, prefixes: Iterable[str]) -> dict[str, Tensor]:
    wanted = tuple(prefixes)  # () matches nothing
    return {name: t for name, t in model.state_dict().items() if name.startswith(wanted)}


def _describe(what: str, items: list[str]) -> str:
    if not items:
        return ""
    shown = ", ".join(items[:_SHOWN])
    more = f" ... and {len(items) - _SHOWN} more" if len(items) > _SHOWN else ""
    return f"{len(items)} {what}: {shown}{more}"
