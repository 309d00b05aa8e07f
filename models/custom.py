"""Bring your own model: `"package.module:factory"` names a callable that builds it.

The factory is called with the caller's keyword options, plus `num_classes` and `input_shape`
when its signature names those parameters. It returns one of:
1. a sequence of `(name, nn.Module)` blocks: every block boundary becomes a cut;
2. `(module, cut_after)`: an `nn.Module` and the ordered names of its top-level children to cut
   after. The module must be a sequential composition of its children (its `forward(x)` must
   equal applying the children in registration order); this is checked on a random batch, and
   a module with parameters or buffers of its own, outside its children, is refused;
3. a `SplitNet`, used as it is (its input shape and class count must match the request).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import torch
from torch import nn

from models.errors import ModelSpecError
from models.heads import HeadFactory, default_head
from models.split import SplitNet, evaluating

_CHECK_BATCH = 2
_CHECK_SEED = 0
_NOT_SEQUENTIAL_HINT = "the module a sequential composition of its top-level children?"


def load_factory(
    spec: str,
    *,
    input_shape: Sequence[int],
    num_classes: int,
    head_factory: HeadFactory = default_head,
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


def resolve_factory(spec: str) -> Callable[..., Any]:
    """The callable named by `"package.module:attr"` (`attr` may be dotted, e.g. `Cls.build`)."""
    module_name, sep, attr_path = spec.partition(":")
    if not sep or not module_name or not attr_path:
        raise ModelSpecError(f"model spec {spec!r} must look like 'package.module:factory'")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSpecError(
            f"cannot import module {module_name!r} of model spec {spec!r}: {exc}"
        ) from exc
    except Exception as exc:
        raise ModelSpecError(
            f"importing {module_name!r} for model spec {spec!r} failed: {exc!r}"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(target, part):
            raise ModelSpecError(
                f"module {module_name!r} has no attribute {attr_path!r} (spec {spec!r})"
            )
        target = getattr(target, part)
    if not callable(target):
        raise ModelSpecError(f"{spec!r} names a {type(target).__name__}, not a callable")
    return target  # type: ignore[no-any-return]


def split_module(
    module: nn.Module,
    cut_after: Sequence[str],
    *,
    input_shape: Sequence[int],
    num_classes: int,
    head_factory: HeadFactory = default_head,
) -> SplitNet:
    """Split `module`'s top-level children into blocks ending at each name in `cut_after`.

    Block `i` is an `nn.Sequential` of the children after cut `i-1` up to cut `i`, keyed by the
    child names (state names `blocks.<i>.<child>.<...>`); it is named after its last child, so
    the cuts keep the names given. The children after the last cut form the final block.
    """
    if isinstance(cut_after, str):
        raise ModelSpecError(
            f"cut_after must be a sequence of child names, got the string {cut_after!r}"
        )
    _check_no_own_state(module)
    children = list(module.named_children())
    names = [name for name, _ in children]
    positions = []
    for cut in cut_after:
        if cut not in names:
            raise ModelSpecError(
                f"{cut!r} is not a top-level child of {type(module).__name__}; children are {names}"
            )
        positions.append(names.index(cut))
    if not positions or positions != sorted(set(positions)):
        raise ModelSpecError(
            f"cut_after must name distinct children in order, got {list(cut_after)}"
        )
    if positions[-1] == len(children) - 1:
        raise ModelSpecError(f"cannot cut after the last child {names[-1]!r}: no server side left")
    bounds = [-1, *positions, len(children) - 1]
    blocks: list[tuple[str, nn.Module]] = [
        (names[end], nn.Sequential(OrderedDict(children[start + 1 : end + 1])))
        for start, end in itertools.pairwise(bounds)
    ]
    try:
        net = SplitNet(
            blocks,
            input_shape=input_shape,
            num_classes=num_classes,
            cuts=tuple(cut_after),
            head_factory=head_factory,
        )
    except ModelSpecError as exc:
        raise ModelSpecError(f"{exc} (is {_NOT_SEQUENTIAL_HINT})") from exc
    _check_sequential(module, net)
    return net


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
            f"model factory {spec!r} does not accept options {sorted(kwargs)}: {exc}"
        ) from exc
    return kwargs


def _to_split_net(
    spec: str,
    result: object,
    input_shape: tuple[int, ...],
    num_classes: int,
    head_factory: HeadFactory,
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
        "(name, nn.Module) blocks, a (nn.Module, [child names to cut after]) pair, or a SplitNet"
    )


def _is_sequence_of(value: object, kind: type) -> TypeGuard[Sequence[Any]]:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and all(isinstance(item, kind) for item in value)
    )


def _check_no_own_state(module: nn.Module) -> None:
    own = [name for name, _ in module.named_parameters(recurse=False)]
    own += [name for name, _ in module.named_buffers(recurse=False)]
    if own:
        raise ModelSpecError(
            f"{type(module).__name__} holds parameters/buffers outside its children ({own}); "
            "splitting its children would drop them"
        )


def _check_sequential(module: nn.Module, net: SplitNet) -> None:
    """Refuse a module whose forward is more than its children applied in order (a flatten in
    `forward`, a skip connection across children...): splitting it would change the model."""
    tensors = (*module.parameters(), *module.buffers())
    device = tensors[0].device if tensors else torch.device("cpu")
    generator = torch.Generator(device=device).manual_seed(_CHECK_SEED)
    x = torch.randn((_CHECK_BATCH, *net.input_shape), generator=generator, device=device)
    with evaluating([module]):
        try:
            expected = module(x)
        except Exception as exc:
            raise ModelSpecError(
                f"{type(module).__name__} failed on input shape {net.input_shape}: {exc!r}"
            ) from exc
        try:
            got = net(x)
        except Exception as exc:
            raise ModelSpecError(
                f"applying the children of {type(module).__name__} in order failed: {exc!r} "
                f"(is {_NOT_SEQUENTIAL_HINT})"
            ) from exc
    if not (
        isinstance(expected, torch.Tensor)
        and expected.shape == got.shape
        and torch.allclose(expected, got, rtol=1e-4, atol=1e-5)
    ):
        raise ModelSpecError(
            f"{type(module).__name__}.forward is not its children applied in order; "
            "return (name, module) blocks instead, or make it a sequential composition"
        )
