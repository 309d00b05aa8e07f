"""The job's model trained in-process, one client and one server, exactly as the split
algorithms exchange tensors: plain split (client body, server rest) or U-shaped (client body,
server middle, client tail), with the client-side defences applied where the client applies
them, and the gradients the server would see kept for the attacks.

One step, plain: z = body(x); the client sends z' = smashed(z) (the defended copy); the server
computes the loss on its logits and returns dL/dz'; the client backpropagates it through
smashed and body, plus the NoPeek term on (x, z') when there is one.
U-shaped: the server returns h = middle(z'); the client computes the loss with its tail and
sends g = gradient(dL/dh) (the defended copy); the server backpropagates g and returns dL/dz'.
The server's optimizer steps on its blocks, the client's on body and tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from models.errors import ModelSpecError
from models.split import SplitNet, evaluating
from services.algorithms.base import Hyper

Transform = Callable[[Tensor], Tensor]
Regulariser = Callable[[Tensor, Tensor], Tensor]


def _identity(t: Tensor) -> Tensor:
    return t


@dataclass(frozen=True)
class ClientHooks:
    """The client's defences as three hooks: `smashed` on z before it leaves (clipping, noise),
    `gradient` on dL/dh before it leaves (U-shaped only), `regulariser(x, z')` added to the
    client's loss on the defended z' (NoPeek). The defaults change nothing."""

    smashed: Transform = _identity
    gradient: Transform = _identity
    regulariser: Regulariser | None = None


@dataclass(frozen=True)
class SplitParts:
    """Views of one `SplitNet`'s blocks (sharing its modules): the client's body up to the
    cut, the server's blocks after it, and in U-shaped mode the client's tail (the last
    `tail_blocks` blocks, which the server then does not hold)."""

    body: nn.Sequential
    server: nn.Sequential
    tail: nn.Sequential | None

    @classmethod
    def of(cls, net: SplitNet, cut: str, *, ushaped: bool, tail_blocks: int = 1) -> SplitParts:
        start = net.cut_index(cut) + 1
        stop = len(net.blocks) - (tail_blocks if ushaped else 0)
        if ushaped and tail_blocks < 1:
            raise ModelSpecError(f"a U-shaped split needs tail_blocks >= 1, got {tail_blocks}")
        if start >= stop:
            raise ModelSpecError(
                f"cut {cut!r} with a tail of {tail_blocks} block(s) leaves the server no "
                f"block of {net.block_names}"
            )
        tail = net.block_range(stop, len(net.blocks)) if ushaped else None
        return cls(net.block_range(0, start), net.block_range(start, stop), tail)

    def client_parameters(self) -> Iterator[nn.Parameter]:
        yield from self.body.parameters()
        if self.tail is not None:
            yield from self.tail.parameters()

    def modules(self) -> list[nn.Module]:
        return [m for m in (self.body, self.server, self.tail) if m is not None]

    def logits(self, x: Tensor, defences: ClientHooks) -> Tensor:
        """The whole model's output on `x` with the smashed-data defence on (no training)."""
        h: Tensor = self.server(defences.smashed(self.body(x)))
        return h if self.tail is None else self.tail(h)


@dataclass(frozen=True)
class StepRecord:
    sent_gradient: Tensor | None
    """U-shaped: the defended dL/dh the server received, one row per example."""


@dataclass
class SplitTrainer:
    parts: SplitParts
    hyper: Hyper
    defences: ClientHooks

    def __post_init__(self) -> None:
        self.client_opt = self.hyper.client_optimizer(self.parts.client_parameters())
        self.server_opt = self.hyper.server_optimizer(self.parts.server.parameters())

    def step(self, x: Tensor, y: Tensor) -> StepRecord:
        parts, defences = self.parts, self.defences
        for module in parts.modules():
            module.train()
        self.client_opt.zero_grad()
        self.server_opt.zero_grad()
        z = parts.body(x)
        sent = defences.smashed(z)
        received = sent.detach().requires_grad_()
        h = parts.server(received)
        sent_gradient: Tensor | None = None
        if parts.tail is None:
            self.hyper.loss(h, y).backward()
        else:
            h_client = h.detach().requires_grad_()
            self.hyper.loss(parts.tail(h_client), y).backward()
            assert h_client.grad is not None
            sent_gradient = defences.gradient(h_client.grad).detach()
            h.backward(sent_gradient)
        assert received.grad is not None
        client_objective = (sent * received.grad).sum()
        if defences.regulariser is not None:
            client_objective = client_objective + defences.regulariser(x, sent)
        client_objective.backward()
        self.server_opt.step()
        self.client_opt.step()
        return StepRecord(sent_gradient)


def accuracy(parts: SplitParts, defences: ClientHooks, x: Tensor, y: Tensor, batch: int) -> float:
    """Test accuracy of the split model, the smashed-data defence applied as in training."""
    correct = 0
    with evaluating(parts.modules()):
        for start in range(0, len(y), batch):
            logits = parts.logits(x[start : start + batch], defences)
            correct += int((logits.argmax(dim=1) == y[start : start + batch]).sum())
    return correct / max(1, len(y))


def smashed(parts: SplitParts, x: Tensor, batch: int = 1024) -> Tensor:
    """The body's undefended output on `x` in eval mode (what defences are then applied to)."""
    with evaluating([parts.body]):
        return torch.cat([parts.body(x[i : i + batch]) for i in range(0, len(x), batch)])
