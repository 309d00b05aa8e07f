"""Two model files compared tensor by tensor: `splitmq replay --check` (issue 36).

Bit-identical is the target for a replay on the machine and torch threads of its run; the
largest absolute and relative difference per tensor say how far off anything else is.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file


@dataclass(frozen=True)
class TensorDiff:
    name: str
    identical: bool  # the same dtype, shape and bytes
    max_abs: float  # inf when shapes or dtypes differ, or a tensor is missing on one side
    max_rel: float  # max |a - b| / max(|a|, tiny), over the tensor's elements
    note: str = ""


def load_model(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; `ValueError` naming the file when it is not one."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc})") from None


def compare_models(expected: Path, actual: Path) -> list[TensorDiff]:
    """Every tensor of either file, the least alike first."""
    a, b = load_model(expected), load_model(actual)
    diffs = [_diff(name, a.get(name), b.get(name)) for name in sorted(set(a) | set(b))]
    return sorted(diffs, key=lambda d: (d.identical, -d.max_rel, -d.max_abs, d.name))


def _diff(name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> TensorDiff:
    inf = float("inf")
    if a is None or b is None:
        side = "replay" if b is None else "run"
        return TensorDiff(name, False, inf, inf, f"missing from the {side}'s model")
    if a.dtype != b.dtype or a.shape != b.shape:
        note = f"{a.dtype}{tuple(a.shape)} against {b.dtype}{tuple(b.shape)}"
        return TensorDiff(name, False, inf, inf, note)
    identical = torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    if identical or a.numel() == 0:
        return TensorDiff(name, True, 0.0, 0.0)
    if not a.is_floating_point():
        differ = int((a != b).sum())
        return TensorDiff(name, False, inf, inf, f"{differ} of {a.numel()} values differ")
    x, y = a.double(), b.double()
    gap = (x - y).abs()
    scale = x.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return TensorDiff(name, False, float(gap.max()), float((gap / scale).max()))


def diff_report(diffs: list[TensorDiff], *, limit: int = 10) -> str:
    """One line per tensor that differs (the `limit` worst), or one saying all are equal."""
    different = [d for d in diffs if not d.identical]
    if not different:
        return f"bit-identical: all {len(diffs)} tensors"
    lines = [f"{len(different)} of {len(diffs)} tensors differ (largest difference per tensor):"]
    for d in different[:limit]:
        extra = f"  ({d.note})" if d.note else ""
        lines.append(f"  {d.name}: max abs {d.max_abs:.3g}, max rel {d.max_rel:.3g}{extra}")
    if len(different) > limit:
        lines.append(f"  ... and {len(different) - limit} more")
    return "\n".join(lines)
