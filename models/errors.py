"""Errors of the model package, rooted in `ValueError`: each reports a bad argument (a spec, a
name, a state dict), and code that only knows the standard library can still catch it.

Not under broker's `SplitMQError`: models and broker are both bottom layers and know nothing of
each other. The code that catches `SplitMQError` around model code (`keep_model`, the version
file) catches `ValueError` too, and the CLI names `ModelError` among the user's errors
(services/common/user_errors.py), so a model error reads as before.
"""

from __future__ import annotations


class ModelError(ValueError):
    """Base class of model-package errors."""


class ModelSpecError(ModelError):
    """A model could not be built as asked: unknown name or cut, bad factory, bad layout."""


class StateDictError(ModelError):
    """A partial state dict does not fit a model: unknown names, wrong shapes, non-tensors."""
