"""`SplitNet`: a network as an ordered chain of named blocks, cut points and auxiliary heads.

A cut is named after the block it follows: cutting at `layer2` gives the client every block up
to and including `layer2` and the server every block after it. The full model's state-dict
names are the one naming scheme everything else uses (`blocks.<i>.<...>` for block `i`,
`heads.<cut>.<...>` for the head of a cut), so a client's, a shard's and the aggregate's
tensors line up by name whatever the cut, which is what heterogeneous averaging needs.

A U-shaped split (`set_tail`) hands the blocks from a tail block on back to the client: the
client runs blocks up to the cut and the tail, the server only those in between, so the labels
never leave the client (docs/architecture.md, "U-shaped split").

Depth levels (FedSplitX) count cuts from 1: level m is `cuts[m - 1]`, and a client at level m
holds the blocks up to that cut and the heads of the first m cuts (`forward_heads`).
"""

from __future__ import annotations

import math
import re
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from models.errors import ModelSpecError
from models.heads import HeadFactory, default_head

Shape = tuple[int, ...]

# Names become ModuleDict keys and parts of state-dict names: no dots, no clash with the
# attributes of ModuleDict itself ("keys", "update", "train"...).
_NAME = re.compile(r"[A-Za-z0-9_]+\Z")
_RESERVED = frozenset(dir(nn.ModuleDict()))


def check_name(name: str, what: str) -> None:
    if not isinstance(name, str) or not _NAME.match(name) or name in _RESERVED:
        raise ModelSpecError(
            f"{what} name {name!r} is not usable: it must be made of ASCII letters, digits "
            "and underscores, and not be an nn.ModuleDict attribute"
        )


class SplitNet(nn.Module):
    """A chain of named blocks; `forward` applies them in order and returns the logits.

    `cuts` are block names (default: every block but the last), in block order; the last block
    cannot be a cut because the server would have nothing to run. One head per cut is built
    by `head_factory(cut_shape, num_classes)`; shapes come from a dummy forward of a zero batch
    in eval mode at construction (no state changes), which also checks that the chain ends in
    `(num_classes,)`. Heads are created on the default device: build on the CPU, then `.to()`.
    """

    def __init__(
        self,
        blocks: Sequence[tuple[str, nn.Module]],
        *,
        input_shape: Sequence[int],
        num_classes: int,
        cuts: Sequence[str] | None = None,
        head_factory: HeadFactory | None = default_head,
    ) -> None:
        super().__init__()
        names = tuple(name for name, _ in blocks)
        _check_blocks(blocks, names)
        if num_classes < 1:
            raise ModelSpecError(f"num_classes must be >= 1, got {num_classes}")
        cut_names = names[:-1] if cuts is None else tuple(cuts)
        _check_cuts(cut_names, names)

        self.block_names: tuple[str, ...] = names
        self.cuts: tuple[str, ...] = cut_names
        self.input_shape: Shape = tuple(int(d) for d in input_shape)
        self.num_classes = num_classes
        self.blocks = nn.ModuleList(module for _, module in blocks)

        self._shapes: tuple[Shape, ...] = tuple(infer_shapes(list(self.blocks), self.input_shape))
        if self._shapes[-1] != (num_classes,):
            raise ModelSpecError(
                f"the last block {names[-1]!r} outputs shape {self._shapes[-1]} per sample, "
                f"expected ({num_classes},) for num_classes={num_classes}"
            )
        # No factory: a model without auxiliary heads (its algorithm trains none).
        self.heads = nn.ModuleDict(
            {}
            if head_factory is None
            else {cut: head_factory(self.cut_shape(cut), num_classes) for cut in self.cuts}
        )
        # The first block of the client's tail in a U-shaped split; None: the server runs
        # every block after the cut.
        self.tail: str | None = None

    def set_tail(self, tail: str | None, cut: str) -> None:
        """Make the split U-shaped: blocks from `tail` on run on the client after the server's
        part, which keeps at least one block after `cut`. None or "": not U-shaped."""
        if not tail:
            self.tail = None
            return
        names = self.block_names
        if tail not in names:
            raise ModelSpecError(f"model.tail {tail!r} is not a block name; blocks are {names}")
        start, at = self.cut_index(cut) + 1, names.index(tail)
        if at <= start:
            server = names[start] if start < len(names) else "none"
            raise ModelSpecError(
                f"model.tail {tail!r} leaves the server no block after the cut {cut!r}: the "
                f"tail must start after {server!r} (blocks are {names})"
            )
        self.tail = tail

    # --- structure ----------------------------------------------------------------------------
    def cut_index(self, cut: str) -> int:
        """Index of the block the cut follows: the client runs blocks `[0, cut_index]`."""
        if cut not in self.cuts:
            raise ModelSpecError(f"unknown cut {cut!r}; this model's cuts are {self.cuts}")
        return self.block_names.index(cut)

    def cut_shape(self, cut: str) -> Shape:
        """The activation shape at `cut`, without the batch dimension."""
        return self._shapes[self.cut_index(cut)]

    def server_end(self) -> int:
        """Index one past the server's last block: the tail's first block, else the end."""
        return len(self.blocks) if self.tail is None else self.block_names.index(self.tail)

    def server_output_shape(self) -> Shape:
        """What the server's last block outputs per sample: a U-shaped tail's input."""
        return self._shapes[self.server_end() - 1]

    # --- views sharing this model's modules ---------------------------------------------------
    def block_range(self, start: int, stop: int) -> nn.Sequential:
        """Blocks `[start:stop]` as a Sequential whose child names are the block indices, so its
        state-dict names are the full model's without the `blocks.` prefix."""
        if not 0 <= start < stop <= len(self.blocks):
            raise ModelSpecError(
                f"block range [{start}:{stop}] is empty or outside 0..{len(self.blocks)}"
            )
        return nn.Sequential(OrderedDict((str(i), self.blocks[i]) for i in range(start, stop)))

    def client_blocks(self, cut: str) -> nn.Sequential:
        return self.block_range(0, self.cut_index(cut) + 1)

    def server_blocks(self, cut: str) -> nn.Sequential:
        """The blocks after `cut`, up to the tail when the split is U-shaped."""
        return self.block_range(self.cut_index(cut) + 1, self.server_end())

    def tail_blocks(self) -> nn.Sequential:
        """A U-shaped split's client tail: from the tail block to the last one."""
        if self.tail is None:
            raise ModelSpecError("this split is not U-shaped: it has no client tail")
        return self.block_range(self.server_end(), len(self.blocks))

    def head(self, cut: str) -> nn.Module:
        self.cut_index(cut)
        if cut not in self.heads:
            raise ModelSpecError(
                f"this model has no auxiliary head at {cut!r}: it was built without heads "
                "(only algorithms that train heads get them)"
            )
        return self.heads[cut]

    # --- forward ------------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _check_blocks(blocks: Sequence[tuple[str, nn.Module]], names: tuple[str, ...]) -> None:
    if len(blocks) < 2:
        raise ModelSpecError(f"a split model needs at least 2 blocks, got {len(blocks)}")
    for name, module in blocks:
        check_name(name, "block")
        if not isinstance(module, nn.Module):
            raise ModelSpecError(f"block {name!r} is a {type(module).__name__}, not an nn.Module")
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ModelSpecError(f"duplicate block names: {duplicates}")


def _check_cuts(cuts: tuple[str, ...], names: tuple[str, ...]) -> None:
    if not cuts:
        raise ModelSpecError("a split model needs at least one cut")
    for cut in cuts:
        if cut not in names:
            raise ModelSpecError(f"cut {cut!r} is not a block name; blocks are {names}")
        if cut == names[-1]:
            raise ModelSpecError(f"cannot cut after the last block {cut!r}: no server side left")
    indices = [names.index(cut) for cut in cuts]
    if indices != sorted(set(indices)):
        raise ModelSpecError(f"cuts must be distinct and in block order, got {cuts}")


def forward_heads(
    blocks: nn.Sequential,
    heads: Mapping[int, tuple[str, nn.Module]],
    x: Tensor,
    start: int = 0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """`blocks` (a `block_range`, children named by block index) on `x` from block `start` on,
    and by cut the logits of `heads` (keyed by the index of the block each follows) on the
    way, in block order."""
    aux: dict[str, Tensor] = {}
    for name, block in blocks.named_children():
        index = int(name)
        if index < start:
            continue
        x = block(x)
        if index in heads:
            cut, head = heads[index]
            aux[cut] = head(x)
    return x, aux


@contextmanager
def evaluating(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Eval mode and no autograd inside; every training flag restored after, so a probe
    forward leaves BatchNorm running stats and dropout state as they were."""
    modules = list(modules)
    flags = [(m, m.training) for module in modules for m in module.modules()]
    try:
        for module in modules:
            module.eval()
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


# Two samples, not one: a module may squeeze or normalise across the batch dimension.
_PROBE_BATCH = 2


def infer_shapes(modules: Sequence[nn.Module], input_shape: Sequence[int]) -> list[Shape]:
    """The per-sample output shape of each module when they are applied in order, from one
    forward of a zero batch (`evaluating`). (The meta device would skip the compute, but its
    first use imports ~2 s of decompositions per process, more than a 2-sample forward of
    ResNet-18 costs on a CPU.)
    """
    tensors = [t for module in modules for t in (*module.parameters(), *module.buffers())]
    device = tensors[0].device if tensors else torch.device("cpu")
    x = torch.zeros((_PROBE_BATCH, *input_shape), device=device)
    shapes: list[Shape] = []
    with evaluating(modules):
        for module in modules:
            try:
                x = module(x)
            except Exception as exc:
                raise ModelSpecError(
                    f"dummy forward of {type(module).__name__} on input shape "
                    f"{tuple(x.shape[1:])} failed: {exc}"
                ) from exc
            if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[0] != _PROBE_BATCH:
                raise ModelSpecError(
                    f"{type(module).__name__} must map a batch tensor to a batch tensor; "
                    f"got {type(x).__name__}"
                    + (f" of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else "")
                )
            shapes.append(tuple(int(d) for d in x.shape[1:]))
    return shapes


def flat_features(modules: Sequence[nn.Module], input_shape: Sequence[int]) -> int:
    """How many features the output of `modules` has per sample once flattened."""
    shapes = infer_shapes(modules, input_shape)
    return math.prod(shapes[-1]) if shapes else math.prod(input_shape)
