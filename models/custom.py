"""Bring your own model: a spec (`models.factories`) names a callable that builds it.

The factory is called with the caller's keyword options (`[model.options]`), plus
`num_classes` and `input_shape` when its signature names those parameters. It returns one of:
1. a sequence of `(name, nn.Module)` blocks, applied in order: every block boundary is a cut;
2. `(module, cuts)`: any `nn.Module` and the qualified names of the submodules to cut after,
   in call order (`["layer1", "layer3.1"]`), split by torch.fx (`models.fxsplit`);
3. a `SplitNet`, used as it is (its input shape and class count must match the request).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

from torch import nn

from models.errors import ModelSpecError
from models.factories import resolve_factory
from models.fxsplit import split_module
from models.heads import HeadFactory, default_head
from models.split import SplitNet


def load_factory(
    spec: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    head_factory: HeadFactory | None = default_head,
    **options: Any,
) -> SplitNet:
    """Import the factory named by `spec`, call it and turn its result into a `SplitNet`."""
    factory = resolve_factory(spec)
    kwargs = _factory_kwargs(spec, factory, options, input_shape, num_classes)
    try:
        result = factory(**kwargs)
    except Exception as exc:
        raise ModelSpecError(f"model factory {spec!r} failed: {exc!r}") from exc
    return _to_split_net(spec, result, tuple(input_shape), num_classes, head_factory)


def _factory_kwargs(
    spec: str,
    factory: Callable[..., Any],
    options: dict[str, Any],
    input_shape: Sequence[int],
    num_classes: int,
) -> dict[str, Any]:
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return dict(options)  # builtins without a signature get exactly the caller's options
    kwargs = dict(options)
    injected = {"num_classes": num_classes, "input_shape": tuple(input_shape)}
    for name, value in injected.items():
        if name in signature.parameters and name not in kwargs:
            kwargs[name] = value
    try:
        signature.bind(**kwargs)
    except TypeError as exc:
        raise ModelSpecError(
            f"model factory {spec!r} does not accept options {sorted(kwargs)}: {exc}; its "
            f"parameters are {list(signature.parameters)}"
        ) from exc
    return kwargs


def _to_split_net(
    spec: str,
    result: object,
    input_shape: tuple[int, ...],
    num_classes: int,
    head_factory: HeadFactory | None,
) -> SplitNet:
    if isinstance(result, SplitNet):
        if result.input_shape != input_shape or result.num_classes != num_classes:
            raise ModelSpecError(
                f"model factory {spec!r} built a SplitNet for input {result.input_shape} and "
                f"{result.num_classes} classes; asked for {input_shape} and {num_classes}"
            )
        return result
    kwargs: dict[str, Any] = {
        "input_shape": input_shape,
        "num_classes": num_classes,
        "head_factory": head_factory,
    }
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        module, cuts = result
        if _is_sequence_of(cuts, str):
            return split_module(module, list(cuts), **kwargs)
    if _is_sequence_of(result, tuple) and all(
        len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], nn.Module)
        for item in result
    ):
        return SplitNet(list(result), **kwargs)
    raise ModelSpecError(
        f"model factory {spec!r} returned {type(result).__name__}; expected a sequence of "
        "(name, nn.Module) blocks, a (nn.Module, [module names to cut after]) pair, or a SplitNet"
    )


def _is_sequence_of(value: object, kind: type) -> TypeGuard[Sequence[Any]]:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, kind) for item in value)
    )
