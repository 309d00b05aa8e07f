"""FedSplitX's math as pure functions: the two losses, the depth levels, heteroavg's holders.

A model has M partition points (level cuts) c_1..c_M, shallow to deep. A client at level m runs
the blocks up to c_m and the heads a_1..a_m; the server runs the rest for it.

- client loss: `sum_{i<=m} l(a_i(z_i), y)`, z_i the activation at c_i (`local_loss`);
- server loss for a batch from level m: `sum_{i>m} l(a_i(z_i), y) + l(f(x), y)` (`server_loss`);
- heteroavg: each tensor is the weighted mean over those that trained it this round (a client
  holding it, a shard replica that ran batches through it), weighted by the samples each
  trained it on; a tensor nobody trained keeps its previous value (`heteroavg`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from services.algorithms.averaging import holder_average

State = Mapping[str, Tensor]
Holding = tuple[State, float]  # a state and the samples it was trained on


def parse_cuts(text: str) -> tuple[str, ...]:
    """`"block1, block2"` → ("block1", "block2"); empty text gives ()."""
    cuts = tuple(part.strip() for part in text.split(",") if part.strip())
    if len(set(cuts)) != len(cuts):
        raise ValueError(f"partition points must be distinct, got {text!r}")
    return cuts


def local_loss(head_logits: Sequence[Tensor], y: Tensor) -> Tensor:
    """The client's loss `sum_{i<=m} l(a_i(z_i), y)` over its heads' logits."""
    if not head_logits:
        raise ValueError("a client trains at least one head")
    return torch.stack([F.cross_entropy(logits, y) for logits in head_logits]).sum()


def server_loss(head_logits: Sequence[Tensor], output: Tensor, y: Tensor) -> Tensor:
    """The server's loss for one batch: `sum_{i>m} l(a_i(z_i), y) + l(output, y)`."""
    return torch.stack([F.cross_entropy(t, y) for t in (*head_logits, output)]).sum()


def assign_level(capability: int, levels: int, default: int) -> int:
    """The depth level of a client declaring `capability` (the deepest level it can run):
    itself, capped at the `levels` there are; `default` (also capped) when it declares none."""
    if levels < 1:
        raise ValueError(f"need at least one level, got {levels}")
    wanted = capability if capability > 0 else default
    return max(1, min(wanted, levels))


def tensor_depth(name: str, cut_index: Mapping[str, int]) -> int | None:
    """Where a state-dict name sits in the chain: block i for `blocks.<i>.*`, and for the head
    of cut c (`heads.<c>.*`) the index of the block c follows; None for other names."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] == "blocks" and parts[1].isdigit():
        return int(parts[1])
    if len(parts) >= 2 and parts[0] == "heads" and parts[1] in cut_index:
        return cut_index[parts[1]]
    return None


def replica_holdings(
    weights: State,
    cut_samples: Mapping[str, int],
    cut_index: Mapping[str, int],
    trained_heads: Collection[str],
) -> list[Holding]:
    """A shard replica as heteroavg holders: its tensors grouped by the samples that went
    through them. A batch from cut c trains the blocks after c and the heads in `trained_heads`
    after c, so a tensor at depth d was trained on the rows of every cut before d; tensors no
    batch reached (weight 0) are not held."""
    unknown = sorted(set(cut_samples) - set(cut_index))
    if unknown:
        raise ValueError(f"replica trained on batches from unknown cuts {unknown}")
    groups: dict[float, dict[str, Tensor]] = {}
    for name, tensor in weights.items():
        depth = tensor_depth(name, cut_index)
        if depth is None:
            continue
        if name.startswith("heads.") and name.split(".")[1] not in trained_heads:
            continue
        samples = float(sum(n for c, n in cut_samples.items() if cut_index[c] < depth))
        if samples > 0:
            groups.setdefault(samples, {})[name] = tensor
    return [(state, samples) for samples, state in groups.items()]


def heteroavg(holdings: Sequence[Holding], previous: State) -> dict[str, Tensor]:
    """Each tensor of `previous` averaged over the holders that hold it, by their samples;
    tensors nobody holds keep their previous value. Holders with no samples are ignored."""
    held = [(state, weight) for state, weight in holdings if weight > 0 and state]
    unknown = sorted({n for state, _ in held for n in state} - set(previous))
    if unknown:
        raise ValueError(f"holders name tensors the model does not have: {unknown[:5]}")
    if not held:
        return dict(previous)
    return holder_average([s for s, _ in held], [w for _, w in held], previous)
