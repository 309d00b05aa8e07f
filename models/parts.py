"""The server side of a `SplitNet` at one cut, as a module of its own.

It shares its modules with the model it comes from (deep-copy one for a private replica) and
names its state exactly as the full model does: `ServerModel(net, cut).state_dict()` is
`server_state(net, cut)` plus the heads of the later cuts, and `load_partial` works on it with
the full model's names.
"""

from __future__ import annotations

from collections.abc import Collection

from torch import Tensor, nn

from models.errors import ModelSpecError
from models.split import SplitNet, forward_heads


class ServerModel(nn.Module):
    """Blocks after `cut` (`theta`) and the heads of the later cuts (FedSplitX's server heads);
    `forward(z)` gives the logits, or in a U-shaped split the last server block's output."""

    def __init__(self, model: SplitNet, cut: str) -> None:
        super().__init__()
        end = model.server_end()  # a U-shaped split's tail stays on the client
        self.blocks = model.block_range(model.cut_index(cut) + 1, end)
        # A model built without heads (an algorithm that trains none) gives the part none.
        later = [
            c
            for c in model.cuts[model.cuts.index(cut) + 1 :]
            if model.cut_index(c) < end and c in model.heads
        ]
        self.cut = cut
        self.heads = nn.ModuleDict({c: model.head(c) for c in later})
        # Each head's cut, keyed by the index of the block it follows.
        self._head_after = {model.cut_index(c): c for c in later}

    def forward(self, z: Tensor) -> Tensor:
        out: Tensor = self.blocks(z)
        return out

    def forward_from(
        self, z: Tensor, cut: str, heads: Collection[str] | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The logits, and the logits of the heads after `cut`, for the activation `z` at `cut`.

        `cut` is this part's cut (every block runs) or a later one whose head it holds (only the
        blocks after that cut run): FedSplitX's server takes batches from clients at several
        depths. `heads` limits which heads run (None: all of them).
        """
        start = 0
        if cut != self.cut:
            after = [i for i, c in self._head_after.items() if c == cut]
            if not after:
                raise ModelSpecError(
                    f"cut {cut!r} is not {self.cut!r} or a cut after it: {sorted(self.heads)}"
                )
            start = after[0] + 1
        run = {
            i: (c, self.heads[c])
            for i, c in self._head_after.items()
            if heads is None or c in heads
        }
        return forward_heads(self.blocks, run, z, start)
