"""The client side and the server side of a `SplitNet` at one cut, as modules of their own.

Both share their modules with the model they come from (deep-copy one for a private replica)
and both name their state exactly as the full model does: `ClientModel(net, cut).state_dict()`
equals `client_state(net, cut, with_heads=True)`, and `load_partial` works on them with the
full model's names.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from torch import Tensor, nn

from models.errors import ModelSpecError
from models.split import SplitNet


class _Part(nn.Module):
    """Blocks `[start:stop]` of a model, as `blocks.<original index>`, plus some of its heads."""

    def __init__(self, model: SplitNet, start: int, stop: int, cuts: Sequence[str]) -> None:
        super().__init__()
        self.blocks = model.block_range(start, stop)
        self.heads = nn.ModuleDict({cut: model.head(cut) for cut in cuts})
        # Head of each cut keyed by the position (within this part) of the block it follows.
        self._head_after = {model.cut_index(cut) - start: cut for cut in cuts}

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.blocks(x)
        return out

    def forward_aux(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The output and the logits of each head of this part on its cut activation."""
        aux: dict[str, Tensor] = {}
        for position, block in enumerate(self.blocks):
            x = block(x)
            cut = self._head_after.get(position)
            if cut is not None:
                aux[cut] = self.heads[cut](x)
        return x, aux


class ClientModel(_Part):
    """Blocks up to and including `cut` (`phi_k`) and the heads of the cuts up to it.

    `forward(x)` is the smashed data `z`; `forward_aux(x)` also gives every head's logits, the
    one at `cut` being SplitGP's `h(z)` and all of them FedSplitX's `a_1..a_m`.
    """

    def __init__(self, model: SplitNet, cut: str) -> None:
        super().__init__(model, 0, model.cut_index(cut) + 1, model.cuts_upto(cut))
        self.cut = cut


class ServerModel(_Part):
    """Blocks after `cut` (`theta`) and the heads of the later cuts (FedSplitX's server heads).

    `forward(z)` gives the logits; `forward_aux(z)` also gives the later heads' logits.
    """

    def __init__(self, model: SplitNet, cut: str) -> None:
        super().__init__(model, model.cut_index(cut) + 1, len(model.blocks), model.cuts_after(cut))
        self.cut = cut

    def forward_from(
        self, z: Tensor, cut: str, heads: Collection[str] | None = None
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The logits, and the logits of the heads after `cut`, for the activation `z` at `cut`.

        `cut` is this part's cut (every block runs) or a later one whose head it holds (only the
        blocks after that cut run): FedSplitX's server takes batches from clients at several
        depths. `heads` limits which heads run (None: all of them).
        """
        if cut == self.cut:
            start = 0
        else:
            after = [p for p, c in self._head_after.items() if c == cut]
            if not after:
                raise ModelSpecError(
                    f"cut {cut!r} is not {self.cut!r} or a cut after it: {sorted(self.heads)}"
                )
            start = after[0] + 1
        aux: dict[str, Tensor] = {}
        for position, block in enumerate(self.blocks):
            if position < start:
                continue
            z = block(z)
            head = self._head_after.get(position)
            if head is not None and (heads is None or head in heads):
                aux[head] = self.heads[head](z)
        return z, aux
