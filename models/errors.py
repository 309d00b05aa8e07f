"""Errors of the model package, in the project hierarchy so callers catch `SplitMQError`.

Both also subclass `ValueError`: each reports a bad argument (a spec, a name, a state dict),
and code that only knows the standard library can still catch it.
"""

from __future__ import annotations

from broker.errors import SplitMQError


class ModelError(SplitMQError):
    """Base class of model-package errors."""


class ModelSpecError(ModelError, ValueError):
    """A model could not be built as asked: unknown name or cut, bad factory, bad layout."""


class StateDictError(ModelError, ValueError):
    """A partial state dict does not fit a model: unknown names, wrong shapes, non-tensors."""
