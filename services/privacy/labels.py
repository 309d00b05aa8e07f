"""Label inference from the gradients a U-shaped client returns (Li et al., "Label Leakage and
Protection in Two-party Split Learning", ICLR 2022).

The server sees, per example, g = dL/dh: the gradient of the client's loss with respect to
the activation h the server sent to the client's tail. Each attack is a scoring function on g;
its leak is the ROC AUC of that score against the true labels (1.0: the labels are fully
recovered by a threshold, 0.5: no better than chance):
- norm attack: score ||g||_2. In a binary task with a rare positive class the model is less
  confident on positives, so |p - y| and with it ||g|| is larger for them;
- cosine (direction) attack: score cos(g, g_ref), g_ref the gradient of one example whose
  label the attacker knows. For a softmax tail, g = W^T (p - onehot(y)), so examples of the
  reference's class point the same way.

For more than two classes each attack is scored one-vs-rest (class c positive, the rest
negative) and the per-class AUCs are averaged; the cosine attack then uses one reference per
class. For two classes only class 1 (the rare positive) is scored: the two one-vs-rest AUCs of
one score sum to 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from services.privacy.metrics import roc_auc


def norm_scores(grads: Tensor) -> Tensor:
    """||g||_2 of each example's gradient (rows of `grads`, flattened)."""
    norms: Tensor = torch.linalg.vector_norm(grads.detach().flatten(1), dim=1)
    return norms


def cosine_scores(grads: Tensor, reference: Tensor) -> Tensor:
    """cos(g, g_ref) of each example's gradient with the reference gradient."""
    flat = grads.detach().flatten(1)
    scores: Tensor = F.cosine_similarity(flat, reference.detach().flatten()[None, :], dim=1)
    return scores


def scored_classes(num_classes: int) -> list[int]:
    """The classes whose one-vs-rest AUC is averaged (see the module docstring)."""
    return [1] if num_classes == 2 else list(range(num_classes))


@dataclass
class LabelLeakMeter:
    """Collects one round's gradients batch by batch and scores both attacks on them.

    The cosine attack's reference for class c in a batch is the first example of class c in
    that batch (the attacker is granted one known label per class and batch); the reference
    itself is left out of that class's scores, and a batch without class c adds none.
    """

    num_classes: int
    _norms: list[Tensor] = field(default_factory=list)
    _labels: list[Tensor] = field(default_factory=list)
    _cosines: dict[int, list[tuple[Tensor, Tensor]]] = field(default_factory=dict)

    def add(self, grads: Tensor, labels: Tensor) -> None:
        self._norms.append(norm_scores(grads))
        self._labels.append(labels.detach())
        for c in scored_classes(self.num_classes):
            where = (labels == c).nonzero().flatten()
            if where.numel() == 0:
                continue
            ref = int(where[0])
            keep = torch.ones_like(labels, dtype=torch.bool)
            keep[ref] = False
            scores = cosine_scores(grads, grads[ref])
            self._cosines.setdefault(c, []).append((scores[keep], labels[keep] == c))

    def aucs(self) -> dict[str, float]:
        """{"norm": AUC, "cosine": AUC} over everything added (NaN before anything was)."""
        if not self._norms:
            return {"norm": math.nan, "cosine": math.nan}
        norms, labels = torch.cat(self._norms), torch.cat(self._labels)
        norm = [roc_auc(norms, labels == c) for c in scored_classes(self.num_classes)]
        cosine = []
        for parts in self._cosines.values():
            scores = torch.cat([s for s, _ in parts])
            positive = torch.cat([p for _, p in parts])
            cosine.append(roc_auc(scores, positive))
        return {"norm": _mean(norm), "cosine": _mean(cosine)}


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if finite else math.nan
