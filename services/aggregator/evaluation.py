"""Accuracy and loss of a version's weights on a test split (docs/architecture.md, "Evaluation").

`evaluate` also counts correct answers per class, so the personalised accuracy of every client
that shares the global model comes from the same single pass over the test set.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from models.split import SplitNet
from models.state import load_partial
from services.algorithms.base import State, StrategyBase, VersionWeights, full_model_weights
from services.common.jobmodel import job_model
from services.config.root import Settings
from services.data.loaders import Split
from services.data.partition import local_test_indices


@dataclass(frozen=True)
class EvalResult:
    accuracy: float
    loss: float  # mean cross-entropy
    samples: int
    class_correct: tuple[int, ...]
    class_total: tuple[int, ...]

    def accuracy_on(self, classes: Iterable[int]) -> float:
        """Accuracy restricted to test samples of `classes` (all classes when empty)."""
        wanted = [c for c in set(classes) if 0 <= c < len(self.class_total)]
        if not wanted:
            return self.accuracy
        total = sum(self.class_total[c] for c in wanted)
        if total == 0:
            return float("nan")
        return sum(self.class_correct[c] for c in wanted) / total


def evaluate(model: SplitNet, weights: State, split: Split, *, batch_size: int = 256) -> EvalResult:
    """Load `weights` into `model` (names it lacks keep their values) and test it on `split`.

    The model is left in eval mode holding `weights`: it is the caller's scratch model.
    """
    load_partial(model, weights)
    model.eval()
    classes = model.num_classes
    correct = torch.zeros(classes, dtype=torch.int64)
    total = torch.zeros(classes, dtype=torch.int64)
    loss_sum = 0.0
    with torch.no_grad():
        for start in range(0, len(split), batch_size):
            x = split.x[start : start + batch_size]
            y = split.y[start : start + batch_size]
            logits = model(x)
            loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
            hits = logits.argmax(dim=1) == y
            total += torch.bincount(y, minlength=classes)[:classes]
            correct += torch.bincount(y[hits], minlength=classes)[:classes]
    n = len(split)
    return EvalResult(
        accuracy=float(correct.sum()) / n if n else float("nan"),
        loss=loss_sum / n if n else float("nan"),
        samples=n,
        class_correct=tuple(int(c) for c in correct),
        class_total=tuple(int(t) for t in total),
    )


@dataclass(frozen=True)
class VersionEval:
    global_accuracy: float
    global_loss: float
    personal_accuracy: float  # mean over the given clients; NaN when there are none
    test_samples: int


class Evaluator:
    """Evaluates versions of one job on (the first `max_samples` of) its test split."""

    def __init__(self, model: SplitNet, test: Split, *, max_samples: int = 0) -> None:
        if max_samples and max_samples < len(test):
            test = Split(test.x[:max_samples], test.y[:max_samples])
        self._model = model
        self._test = test

    def evaluate(self, blobs: VersionWeights, clients: Mapping[str, Sequence[int]]) -> VersionEval:
        """Global metrics, and the mean personalised accuracy over `clients` (id → classes)."""
        shared = evaluate(self._model, full_model_weights(blobs), self._test)
        personal: list[float] = []
        for client, classes in sorted(clients.items()):
            if any(ref.owner == client for ref in blobs):
                personal.append(self._personal(blobs, client, classes))
            else:
                personal.append(shared.accuracy_on(classes))
        personal = [p for p in personal if p == p]  # a client with no local test samples
        return VersionEval(
            global_accuracy=shared.accuracy,
            global_loss=shared.loss,
            personal_accuracy=sum(personal) / len(personal) if personal else float("nan"),
            test_samples=shared.samples,
        )

    def strategy_metrics(
        self, strategy: StrategyBase, blobs: VersionWeights, clients: Mapping[str, Sequence[int]]
    ) -> dict[str, float]:
        """The strategy's own per-client metrics of a version (`personal_metrics` in
        services.algorithms.base), on this evaluator's test rows; {} for most strategies."""
        return strategy.personal_metrics(self._model, blobs, self._test.x, self._test.y, clients)

    def _personal(self, blobs: VersionWeights, client: str, classes: Sequence[int]) -> float:
        """A client with its own weights, on its local test set."""
        test = self._test
        if classes:
            rows = torch.from_numpy(local_test_indices(test.y.numpy(), np.asarray(classes)))
            if len(rows) == 0:
                return float("nan")
            test = Split(test.x[rows], test.y[rows])
        weights = full_model_weights(blobs, client)
        return evaluate(self._model, weights, test).accuracy


def build_evaluator(settings: Settings, test: Split) -> Evaluator:
    """The job's evaluator on `test` (capped at `data.eval_samples`)."""
    return Evaluator(job_model(settings), test, max_samples=settings.data.eval_samples)
